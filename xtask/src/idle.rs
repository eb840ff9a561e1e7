//! Builds that run beside the foreground work at idle priority (`chrt --idle 0`: a CPU only
//! when nothing else wants one), one after another, each with its output in a log file.
//!
//! `cargo xtask test` spends most of its time waiting on the integration tests' servers,
//! whose CPUs are often idle: the unit tests' build, clippy and the fuzz target's build fill
//! that time instead of adding their own (measured here: a CPU-bound job at idle priority
//! slowed a real-Gym test module by 3 %).

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use anyhow::{Context, Result, anyhow, bail};

/// One build of the queue.
pub(crate) struct IdleJob {
    /// Names it in the log lines: "{what} passed".
    pub(crate) what: &'static str,
    pub(crate) cmd: Command,
    pub(crate) log: PathBuf,
    /// What to do when it fails (after "{what} failed: ").
    pub(crate) hint: &'static str,
}

/// The jobs, run in order by a thread of their own; [`IdleQueue::next`] takes their results
/// in the same order. Dropped early (xtask failed), it stops the job that runs.
pub(crate) struct IdleQueue {
    results: mpsc::Receiver<Result<()>>,
    running: Arc<Mutex<Option<Child>>>,
    stopped: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl IdleQueue {
    pub(crate) fn start(jobs: Vec<IdleJob>) -> Self {
        let (send, results) = mpsc::channel();
        let running = Arc::new(Mutex::new(None));
        let stopped = Arc::new(AtomicBool::new(false));
        for job in &jobs {
            println!(
                "xtask: {} will run at idle priority (log: {})",
                job.what,
                job.log.display()
            );
        }
        let thread = {
            let (running, stopped) = (Arc::clone(&running), Arc::clone(&stopped));
            std::thread::spawn(move || {
                for job in jobs {
                    if stopped.load(Ordering::SeqCst) {
                        return;
                    }
                    let result = run_job(job, &running);
                    if send.send(result).is_err() {
                        return;
                    }
                }
            })
        };
        Self {
            results,
            running,
            stopped,
            thread: Some(thread),
        }
    }

    /// Waits for the next job in the order given; its failure (with its log printed) is an
    /// error.
    pub(crate) fn next(&self) -> Result<()> {
        self.results
            .recv()
            .map_err(|_| anyhow!("the idle-priority jobs stopped before this one ran"))?
    }
}

impl Drop for IdleQueue {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::SeqCst);
        if let Ok(mut running) = self.running.lock()
            && let Some(child) = running.as_mut()
        {
            let _ = child.kill();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run_job(job: IdleJob, running: &Mutex<Option<Child>>) -> Result<()> {
    let IdleJob {
        what,
        cmd,
        log,
        hint,
    } = job;
    let file = fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut idle = Command::new("chrt");
    idle.args(["--idle", "0"])
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .stdout(file.try_clone()?)
        .stderr(file);
    if let Some(dir) = cmd.get_current_dir() {
        idle.current_dir(dir);
    }
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => idle.env(key, value),
            None => idle.env_remove(key),
        };
    }
    let child = idle
        .spawn()
        .with_context(|| format!("could not start {what} (`chrt --idle 0 ...`)"))?;
    let mut slot = running.lock().map_err(|_| anyhow!("a poisoned lock"))?;
    *slot = Some(child);
    drop(slot);
    // Polled, not waited on under the lock: Drop must be able to kill it meanwhile.
    let status = loop {
        let mut slot = running.lock().map_err(|_| anyhow!("a poisoned lock"))?;
        let Some(child) = slot.as_mut() else {
            bail!("{what} was stopped");
        };
        if let Some(status) = child.try_wait()? {
            *slot = None;
            break status;
        }
        drop(slot);
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    if !status.success() {
        eprintln!("{}", fs::read_to_string(&log).unwrap_or_default());
        bail!("{what} failed ({status}): {hint}");
    }
    println!("xtask: {what} passed (log: {})", log.display());
    Ok(())
}
