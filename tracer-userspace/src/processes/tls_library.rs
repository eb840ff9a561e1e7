//! Which TLS library a traced process encrypts with, found from outside: the files it maps
//! (`/proc/PID/maps`) and the symbols they define. pyenv, venv, distro and container Pythons
//! map different files, so it is looked up per process, and a library is named by its device
//! and inode so that one file mapped by many processes is probed once.

use std::path::{Path, PathBuf};

use crate::model::counters::counters;

counters! {
    /// What the agent did about TLS libraries.
    pub struct TlsProbeCounters {
        /// Attaches of the SSL uprobes to a library file. One per traced process that maps one
        /// (`--tls-probe-scope process`, the default), or one per file (`library`).
        traced tls_libraries_probed,
        /// Attaches of the SSL uprobes that failed. The log names the library and why; HTTPS
        /// requests through it are not traced.
        lost tls_libraries_failed,
        /// Processes that opened a TLS connection the uprobes cannot see into. Statically linked
        /// TLS (Go, Rust) or a library other than OpenSSL: each is logged once, and its connections
        /// show as `TLS` spans (`tls_connections_unread`).
        note tls_processes_unprobed,
    }
}

/// The OpenSSL functions the uprobes attach to, each with the program for its entry.
/// The `_ex` forms (OpenSSL 1.1.1+) are what CPython's `ssl` module calls.
pub const SSL_FUNCTIONS: [(&str, &str); 4] = [
    ("SSL_write", "ssl_write"),
    ("SSL_write_ex", "ssl_write_ex"),
    ("SSL_read", "ssl_read"),
    ("SSL_read_ex", "ssl_read_ex"),
];

/// One file on the host, whatever path a process reaches it by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FileId {
    /// `major:minor` as maps prints it.
    pub device: String,
    pub inode: u64,
}

/// A mapped file that may hold OpenSSL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappedLibrary {
    pub file: FileId,
    /// The path inside the process's mount namespace.
    pub path: PathBuf,
    pub kind: LibraryKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LibraryKind {
    /// `libssl.so*`: OpenSSL's TLS library.
    OpenSsl,
    /// CPython's `_ssl` extension: holds OpenSSL itself when linked statically.
    PythonSslModule,
    /// A TLS library the uprobes do not know (GnuTLS, NSS, wolfSSL, mbed TLS, BoringSSL's
    /// `libboringssl`).
    Other,
}

/// The files of a maps listing that matter for TLS, each once, in the order first mapped.
pub fn mapped_tls_libraries(maps: &str) -> Vec<MappedLibrary> {
    let mut found: Vec<MappedLibrary> = Vec::new();
    for line in maps.lines() {
        let Some(library) = parse_tls_line(line) else {
            continue;
        };
        if !found.iter().any(|known| known.file == library.file) {
            found.push(library);
        }
    }
    found
}

fn parse_tls_line(line: &str) -> Option<MappedLibrary> {
    let mut fields = line.split_ascii_whitespace();
    let _range = fields.next()?;
    let _perms = fields.next()?;
    let _offset = fields.next()?;
    let device = fields.next()?.to_string();
    let inode: u64 = fields.next()?.parse().ok()?;
    let path = line
        .splitn(6, |c: char| c.is_ascii_whitespace())
        .nth(5)
        .map(str::trim_start)?;
    if inode == 0 || !path.starts_with('/') || path.ends_with(" (deleted)") {
        return None;
    }
    let path = PathBuf::from(path);
    let kind = library_kind(&path)?;
    Some(MappedLibrary {
        file: FileId { device, inode },
        path,
        kind,
    })
}

fn library_kind(path: &Path) -> Option<LibraryKind> {
    let name = path.file_name()?.to_str()?;
    if name.starts_with("libssl.so") {
        Some(LibraryKind::OpenSsl)
    } else if name.starts_with("_ssl.") && name.ends_with(".so") {
        Some(LibraryKind::PythonSslModule)
    } else if [
        "libgnutls.so",
        "libnss3.so",
        "libwolfssl.so",
        "libmbedtls.so",
        "libboringssl",
    ]
    .iter()
    .any(|other| name.starts_with(other))
    {
        Some(LibraryKind::Other)
    } else {
        None
    }
}

/// Which of [`SSL_FUNCTIONS`] an ELF file defines in its dynamic symbol table (a library that
/// only imports them defines none).
pub fn defined_ssl_functions(elf: &[u8]) -> Vec<&'static str> {
    use object::{Object as _, ObjectSymbol as _};
    let Ok(file) = object::File::parse(elf) else {
        return Vec::new();
    };
    let defined: Vec<String> = file
        .dynamic_symbols()
        .filter(|symbol| symbol.is_definition())
        .filter_map(|symbol| symbol.name().ok().map(str::to_string))
        .collect();
    SSL_FUNCTIONS
        .iter()
        .map(|(function, _)| *function)
        .filter(|function| defined.iter().any(|name| name == function))
        .collect()
}

/// `path` as the agent reaches it: through the process's root (a container's files).
pub fn path_in_process(pid: u32, path: &Path) -> PathBuf {
    Path::new(&format!("/proc/{pid}/root")).join(path.strip_prefix("/").unwrap_or(path))
}

/// What the uprobes can do for a process, from the libraries it maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsSupport {
    /// Files to probe (an OpenSSL library, or a `_ssl` module with OpenSSL inside).
    Probe(Vec<MappedLibrary>),
    /// It maps a TLS library the uprobes do not know: named.
    Unsupported(PathBuf),
    /// A `_ssl` module without OpenSSL of its own and no `libssl` beside it.
    StaticUnknown(PathBuf),
    /// Nothing TLS is mapped (yet: CPython loads `_ssl` on `import ssl`).
    Nothing,
}

/// Decides from the mapped libraries; `defines` tells which SSL functions a file defines.
pub fn tls_support(
    libraries: &[MappedLibrary],
    defines: impl Fn(&MappedLibrary) -> Vec<&'static str>,
) -> TlsSupport {
    let openssl: Vec<MappedLibrary> = libraries
        .iter()
        .filter(|library| library.kind == LibraryKind::OpenSsl)
        .cloned()
        .collect();
    if !openssl.is_empty() {
        return TlsSupport::Probe(openssl);
    }
    let modules: Vec<&MappedLibrary> = libraries
        .iter()
        .filter(|library| library.kind == LibraryKind::PythonSslModule)
        .collect();
    let static_openssl: Vec<MappedLibrary> = modules
        .iter()
        .filter(|module| defines(module).contains(&"SSL_write"))
        .map(|module| (*module).clone())
        .collect();
    if !static_openssl.is_empty() {
        return TlsSupport::Probe(static_openssl);
    }
    if let Some(other) = libraries.iter().find(|l| l.kind == LibraryKind::Other) {
        return TlsSupport::Unsupported(other.path.clone());
    }
    match modules.first() {
        Some(module) => TlsSupport::StaticUnknown(module.path.clone()),
        None => TlsSupport::Nothing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
7f0000000000-7f0000001000 r--p 00000000 fd:01 131 /usr/lib/x86_64-linux-gnu/libssl.so.3
7f0000001000-7f0000002000 r-xp 00001000 fd:01 131 /usr/lib/x86_64-linux-gnu/libssl.so.3
7f0000003000-7f0000004000 r-xp 00001000 fd:01 140 /usr/lib/x86_64-linux-gnu/libcrypto.so.3
7f0000005000-7f0000006000 r-xp 00001000 fd:01 77 /root/.pyenv/versions/3.13.0/lib/python3.13/lib-dynload/_ssl.cpython-313-x86_64-linux-gnu.so
7f0000007000-7f0000008000 rw-p 00000000 00:00 0
";

    #[test]
    fn a_library_mapped_several_times_is_one_file() {
        let libraries = mapped_tls_libraries(MAPS);
        assert_eq!(libraries.len(), 2);
        assert_eq!(libraries[0].kind, LibraryKind::OpenSsl);
        assert_eq!(
            libraries[0].file,
            FileId {
                device: "fd:01".into(),
                inode: 131
            }
        );
        assert_eq!(libraries[1].kind, LibraryKind::PythonSslModule);
    }

    #[test]
    fn openssl_beside_the_module_is_what_is_probed() {
        let libraries = mapped_tls_libraries(MAPS);
        let TlsSupport::Probe(probed) = tls_support(&libraries, |_| Vec::new()) else {
            panic!("libssl is mapped");
        };
        assert_eq!(
            probed[0].path,
            Path::new("/usr/lib/x86_64-linux-gnu/libssl.so.3")
        );
    }

    #[test]
    fn a_module_with_openssl_inside_is_probed_itself() {
        let maps = MAPS
            .lines()
            .filter(|line| !line.contains("libssl"))
            .collect::<Vec<_>>()
            .join("\n");
        let libraries = mapped_tls_libraries(&maps);
        let support = tls_support(&libraries, |_| vec!["SSL_write", "SSL_read"]);
        assert!(
            matches!(support, TlsSupport::Probe(ref l) if l[0].kind == LibraryKind::PythonSslModule)
        );
        let without = tls_support(&libraries, |_| Vec::new());
        assert!(matches!(without, TlsSupport::StaticUnknown(_)));
    }

    #[test]
    fn other_tls_libraries_are_named_and_nothing_is_nothing() {
        let maps = "7f0-7f1 r-xp 0 fd:01 9 /usr/lib/libgnutls.so.30\n";
        let libraries = mapped_tls_libraries(maps);
        assert_eq!(
            tls_support(&libraries, |_| Vec::new()),
            TlsSupport::Unsupported("/usr/lib/libgnutls.so.30".into())
        );
        assert_eq!(tls_support(&[], |_| Vec::new()), TlsSupport::Nothing);
    }

    #[test]
    fn this_hosts_libssl_defines_every_probed_function() {
        let Some(path) = [
            "/usr/lib/x86_64-linux-gnu/libssl.so.3",
            "/lib64/libssl.so.3",
        ]
        .iter()
        .find(|p| Path::new(p).exists()) else {
            return; // no system OpenSSL 3 on this machine
        };
        let elf = std::fs::read(path).expect("readable");
        assert_eq!(
            defined_ssl_functions(&elf),
            vec!["SSL_write", "SSL_write_ex", "SSL_read", "SSL_read_ex"]
        );
        assert!(defined_ssl_functions(b"not an elf").is_empty());
    }
}
