//! Which processes the agent traces and what it learns about them from outside: the
//! `--pid` processes and their Gym environment, the labels of discovered servers, and the
//! route table each server publishes at `/openapi.json` (harvested in the background).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use tokio::runtime::Handle;
use tokio::sync::mpsc;

use crate::config::cli::RunArgs;
use crate::gym::ServerKind;
use crate::gym::routes::{RouteTemplate, templates_from_openapi};
use crate::model::service::GymLabels;
use crate::processes::discovery::{GymServer, gym_server_from_env, read_process_env};
use crate::processes::harvest::{SelfPorts, connect_address, fetch_openapi, listening_ports};

/// A server found before it listens is asked for its routes again, this often and this
/// many times.
const HARVEST_RETRY: Duration = Duration::from_secs(1);
const HARVEST_ATTEMPTS: u32 = 60;

/// A route table harvested from a server, for it and its forked workers.
pub struct Harvest {
    pub root: u32,
    pub templates: Vec<RouteTemplate>,
}

pub fn check_pids(pids: &[u32]) -> Result<()> {
    for pid in pids {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            bail!("no process with pid {pid} (is it running, and in this PID namespace?)");
        }
    }
    Ok(())
}

/// Labels from a Gym server's environment and config.
pub fn labels_of(server: &GymServer) -> GymLabels {
    GymLabels {
        server_name: Some(server.name.clone()),
        server_kind: server
            .server_type
            .as_deref()
            .map(ServerKind::from_config_key),
        service_group: server.service_group.clone(),
    }
}

/// Labels of a `--pid` process: its Gym environment if it has one, then the flags.
pub fn labels_of_named(pid: u32, args: &RunArgs) -> (GymLabels, Option<GymServer>) {
    let server = read_process_env(&PathBuf::from("/proc"), pid)
        .ok()
        .and_then(|env| match gym_server_from_env(&env) {
            Ok(server) => server,
            Err(error) => {
                tracing::warn!(pid, "pid {pid}: {error}");
                Some(error.into_server())
            }
        });
    let mut labels = server.as_ref().map(labels_of).unwrap_or_default();
    if args.server_name.is_some() {
        labels.server_name = args.server_name.clone();
    }
    if let Some(server_type) = args.server_type {
        labels.server_kind = Some(ServerKind::Known(server_type));
    }
    (labels, server)
}

/// Where to ask a server for its routes: its configured port, else what it listens on.
/// Blocking: a configured host may need a DNS lookup.
fn harvest_address(pid: u32, server: Option<&GymServer>) -> Option<SocketAddr> {
    if let Some(port) = server.and_then(|s| s.port) {
        return Some(connect_address(
            server.and_then(|s| s.host.as_deref()),
            port,
        ));
    }
    let listening = listening_ports(pid).ok()?;
    listening
        .first()
        .map(|addr| connect_address(Some(&addr.ip().to_string()), addr.port()))
}

/// Asks one server for its `/openapi.json`, patiently: a server found at start-up may not
/// listen yet. Gives up quietly (Gym's known routes still name its requests).
pub fn spawn_harvest(
    exporters: &Handle,
    pid: u32,
    server: Option<GymServer>,
    self_ports: SelfPorts,
    results: mpsc::UnboundedSender<Result<Harvest, String>>,
) {
    exporters.spawn(async move {
        let mut last_error = String::from("it never listened");
        for _ in 0..HARVEST_ATTEMPTS {
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                return;
            }
            let lookup = server.clone();
            let address =
                tokio::task::spawn_blocking(move || harvest_address(pid, lookup.as_ref()))
                    .await
                    .ok()
                    .flatten();
            if let Some(address) = address {
                match fetch_openapi(address, &self_ports).await {
                    Ok(document) => {
                        let result = templates_from_openapi(&document)
                            .map(|templates| Harvest {
                                root: pid,
                                templates,
                            })
                            .map_err(|error| format!("pid {pid}: /openapi.json: {error}"));
                        let _ = results.send(result);
                        return;
                    }
                    Err(error) => last_error = error.to_string(),
                }
            }
            tokio::time::sleep(HARVEST_RETRY).await;
        }
        let _ = results.send(Err(format!("pid {pid}: no route table: {last_error}")));
    });
}
