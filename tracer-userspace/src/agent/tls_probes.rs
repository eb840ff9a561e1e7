//! Which TLS libraries carry the SSL uprobes: each OpenSSL file a traced process maps, attached
//! per traced process (`--tls-probe-scope process`: only traced processes get the breakpoint)
//! or once per file (`library`: every process that maps the file then hits the probes, and the
//! programs act for traced processes only). Looked for when a process is attached, on every
//! rescan while it has none (CPython maps `_ssl` and libssl on `import ssl`), and at once when
//! it opens a TLS connection. A process whose TLS the probes cannot see is said once.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::config::cli::TlsProbeScope;
use crate::kernel::loader::{LoadedProbes, TlsAttachment, uprobe_refusal_hint};
use crate::processes::tls_library::{
    FileId, MappedLibrary, TlsProbeCounters, TlsSupport, defined_ssl_functions,
    mapped_tls_libraries, path_in_process, tls_support,
};

/// Attaching uprobes (a trait so the bookkeeping can be tested without a kernel).
pub trait UprobeAttacher {
    /// For process `pid` only, or (`None`) for every process that maps `library`.
    fn attach_tls_library(
        &mut self,
        library: &Path,
        functions: &[&'static str],
        pid: Option<u32>,
    ) -> Result<TlsAttachment>;
    fn detach_tls(&mut self, attachment: TlsAttachment);
}

impl UprobeAttacher for LoadedProbes {
    fn attach_tls_library(
        &mut self,
        library: &Path,
        functions: &[&'static str],
        pid: Option<u32>,
    ) -> Result<TlsAttachment> {
        LoadedProbes::attach_tls_library(self, library, functions, pid)
    }

    fn detach_tls(&mut self, attachment: TlsAttachment) {
        LoadedProbes::detach_tls(self, attachment);
    }
}

/// One attach: a library file, for one process (`Process` scope) or for all.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct AttachKey {
    file: FileId,
    pid: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum ProcessTls {
    /// Its OpenSSL file is probed.
    Probed(PathBuf),
    /// Nothing (usable) mapped yet; looked at again.
    NotYet,
    /// Said once: it does TLS the probes cannot see.
    Unprobed,
}

pub struct TlsProbes {
    scope: TlsProbeScope,
    /// Attaches made (or that failed: not tried again).
    attached: HashMap<AttachKey, bool>,
    /// What to take back when a process is gone (`Process` scope).
    attachments: HashMap<u32, Vec<TlsAttachment>>,
    processes: HashMap<u32, ProcessTls>,
    /// `--no-tls`: nothing is attached.
    disabled: bool,
    pub counters: TlsProbeCounters,
}

impl TlsProbes {
    pub fn new(scope: TlsProbeScope) -> Self {
        Self {
            scope,
            attached: HashMap::new(),
            attachments: HashMap::new(),
            processes: HashMap::new(),
            disabled: false,
            counters: TlsProbeCounters::default(),
        }
    }

    pub fn disabled() -> Self {
        Self {
            disabled: true,
            ..Self::new(TlsProbeScope::Process)
        }
    }

    /// A process was attached: probe the OpenSSL it maps, if any.
    pub fn attach(&mut self, pid: u32, attacher: &mut impl UprobeAttacher) {
        if self.disabled || self.processes.contains_key(&pid) {
            return;
        }
        self.processes.insert(pid, ProcessTls::NotYet);
        self.look(pid, attacher);
    }

    /// Every rescan: processes without a probed library are looked at again.
    pub fn rescan(
        &mut self,
        traced: impl IntoIterator<Item = u32>,
        attacher: &mut impl UprobeAttacher,
    ) {
        if self.disabled {
            return;
        }
        for pid in traced {
            match self.processes.get(&pid) {
                None => self.attach(pid, attacher),
                Some(ProcessTls::NotYet) => {
                    self.look(pid, attacher);
                }
                Some(_) => {}
            }
        }
    }

    /// `pid` opened a TLS connection: its library must be mapped by now.
    pub fn tls_opened(&mut self, pid: u32, attacher: &mut impl UprobeAttacher) {
        if self.disabled {
            return;
        }
        match self.processes.get(&pid) {
            Some(ProcessTls::Probed(_) | ProcessTls::Unprobed) => return,
            Some(ProcessTls::NotYet) => {}
            // Forgotten at an exec: a new program.
            None => {
                self.processes.insert(pid, ProcessTls::NotYet);
            }
        }
        {
            let support = self.look(pid, attacher);
            if self.processes.get(&pid) == Some(&ProcessTls::NotYet) {
                self.counters.tls_processes_unprobed += 1;
                self.processes.insert(pid, ProcessTls::Unprobed);
                tracing::warn!(
                    pid,
                    "pid {pid} opened a TLS connection, but {}: its HTTPS requests are not \
                     traced (the connection is still followed: timing and bytes)",
                    why_unprobed(&support)
                );
            }
        }
    }

    /// A process is gone (or exec'd): its own uprobes are taken back.
    pub fn forget(&mut self, pid: u32, attacher: &mut impl UprobeAttacher) {
        self.processes.remove(&pid);
        self.attached.retain(|key, _| key.pid != Some(pid));
        for attachment in self.attachments.remove(&pid).unwrap_or_default() {
            attacher.detach_tls(attachment);
        }
    }

    /// The library probed for `pid`.
    #[cfg(test)]
    fn probed_library(&self, pid: u32) -> Option<&Path> {
        match self.processes.get(&pid) {
            Some(ProcessTls::Probed(path)) => Some(path),
            _ => None,
        }
    }

    fn look(&mut self, pid: u32, attacher: &mut impl UprobeAttacher) -> TlsSupport {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
            return TlsSupport::Nothing;
        };
        let libraries = mapped_tls_libraries(&maps);
        let support = tls_support(&libraries, |library| {
            std::fs::read(path_in_process(pid, &library.path))
                .map(|elf| defined_ssl_functions(&elf))
                .unwrap_or_default()
        });
        if let TlsSupport::Probe(files) = &support {
            for library in files {
                if self.probe(pid, library, attacher) {
                    self.processes
                        .insert(pid, ProcessTls::Probed(library.path.clone()));
                }
            }
        }
        support
    }

    /// Attaches to `library` unless done before; true when it is probed.
    fn probe(
        &mut self,
        pid: u32,
        library: &MappedLibrary,
        attacher: &mut impl UprobeAttacher,
    ) -> bool {
        let only = match self.scope {
            TlsProbeScope::Process => Some(pid),
            TlsProbeScope::Library => None,
        };
        let key = AttachKey {
            file: library.file.clone(),
            pid: only,
        };
        if let Some(probed) = self.attached.get(&key) {
            return *probed;
        }
        let path = path_in_process(pid, &library.path);
        let functions = std::fs::read(&path)
            .map(|elf| defined_ssl_functions(&elf))
            .unwrap_or_default();
        let probed = match attacher.attach_tls_library(&path, &functions, only) {
            Ok(attachment) => {
                self.counters.tls_libraries_probed += 1;
                tracing::info!(
                    pid,
                    "TLS plaintext from {} (uprobes on {}), {}",
                    library.path.display(),
                    attachment.functions.join(", "),
                    match only {
                        Some(_) => format!("for pid {pid}"),
                        None => "for every traced process that maps it".to_string(),
                    }
                );
                if only.is_some() {
                    self.attachments.entry(pid).or_default().push(attachment);
                }
                true
            }
            Err(error) => {
                self.counters.tls_libraries_failed += 1;
                let error = format!("{error:#}");
                let hint = uprobe_refusal_hint(&error);
                tracing::warn!(
                    pid,
                    "{error}{hint}; HTTPS requests through it are not traced"
                );
                false
            }
        };
        self.attached.insert(key, probed);
        probed
    }
}

fn why_unprobed(support: &TlsSupport) -> String {
    match support {
        TlsSupport::Unsupported(path) => format!(
            "it encrypts with {}, a TLS library the uprobes do not know (only OpenSSL's \
             SSL_read/SSL_write are probed)",
            path.display()
        ),
        TlsSupport::StaticUnknown(path) => format!(
            "its TLS module {} has no OpenSSL symbols to probe (stripped or statically linked \
             with another library)",
            path.display()
        ),
        TlsSupport::Probe(_) => "its OpenSSL library could not be probed (see above)".into(),
        TlsSupport::Nothing => "it maps no OpenSSL library (statically linked TLS, as in Go or \
             Rust programs, or a library the agent cannot read)"
            .into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        attached: Vec<PathBuf>,
        detached: usize,
    }

    impl UprobeAttacher for Recorder {
        fn attach_tls_library(
            &mut self,
            library: &Path,
            functions: &[&'static str],
            _: Option<u32>,
        ) -> Result<TlsAttachment> {
            self.attached.push(library.to_path_buf());
            let mut attachment = TlsAttachment::default();
            attachment.functions = functions.to_vec();
            Ok(attachment)
        }

        fn detach_tls(&mut self, _: TlsAttachment) {
            self.detached += 1;
        }
    }

    #[test]
    fn the_agents_own_libssl_is_attached_once_for_many_processes() {
        // This test process maps whatever OpenSSL its binary links (none for a pure Rust
        // build): the bookkeeping must attach each file at most once however often asked.
        let me = std::process::id();
        let mut probes = TlsProbes::new(TlsProbeScope::Library);
        let mut recorder = Recorder::default();
        probes.attach(me, &mut recorder);
        probes.rescan([me, me], &mut recorder);
        probes.tls_opened(me, &mut recorder);
        let mut unique = recorder.attached.clone();
        unique.dedup();
        assert_eq!(unique, recorder.attached);
        assert!(recorder.attached.len() <= 1);
    }

    #[test]
    fn a_process_without_openssl_is_said_once() {
        let me = std::process::id();
        let mut probes = TlsProbes::new(TlsProbeScope::Library);
        let mut recorder = Recorder::default();
        probes.attach(me, &mut recorder);
        if probes.probed_library(me).is_some() {
            return; // this build maps OpenSSL: nothing unprobed to check
        }
        probes.tls_opened(me, &mut recorder);
        probes.tls_opened(me, &mut recorder);
        assert_eq!(probes.counters.tls_processes_unprobed, 1);
    }

    #[test]
    fn disabled_attaches_nothing() {
        let mut probes = TlsProbes::disabled();
        let mut recorder = Recorder::default();
        probes.attach(std::process::id(), &mut recorder);
        probes.tls_opened(std::process::id(), &mut recorder);
        assert!(recorder.attached.is_empty());
        assert_eq!(probes.counters, TlsProbeCounters::default());
    }
}
