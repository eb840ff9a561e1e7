//! `/proc/PID/maps`: which file holds CPython in a process, and where it is mapped.

use std::path::{Path, PathBuf};

/// One line of `/proc/PID/maps` that maps a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// Offset in the file of the mapping's first byte: with the ELF segments it gives the load
    /// bias.
    pub file_offset: u64,
    pub path: PathBuf,
}

/// Parses one maps line (`start-end perms offset dev inode path`); `None` for anonymous
/// mappings, pseudo-files (`[heap]`, `[vdso]`) and deleted files, whose symbols cannot be read
/// back from the path.
pub fn parse_line(line: &str) -> Option<Mapping> {
    let mut fields = line.split_ascii_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let _perms = fields.next()?;
    let offset = fields.next()?;
    let _dev = fields.next()?;
    let _inode = fields.next()?;
    // The path is the rest of the line: it may hold spaces.
    let path = line
        .splitn(6, |c: char| c.is_ascii_whitespace())
        .nth(5)
        .map(str::trim_start)?;
    if !path.starts_with('/') || path.ends_with(" (deleted)") {
        return None;
    }
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        file_offset: u64::from_str_radix(offset, 16).ok()?,
        path: PathBuf::from(path),
    })
}

/// CPython's minor version from a shared library's file name: `libpython3.13.so.1.0` →
/// `(3, 13)`. Debug and free-threaded builds (`libpython3.13d.so`, `libpython3.13t.so`) lay
/// their structures out differently and are not recognised: `None`.
pub fn libpython_version(path: &Path) -> Option<(u8, u8)> {
    let name = path.file_name()?.to_str()?;
    let rest = name.strip_prefix("libpython")?;
    let (version, tail) = rest.split_once(".so")?;
    if !(tail.is_empty() || tail.starts_with('.')) {
        return None;
    }
    let (major, minor) = version.split_once('.')?;
    if minor.is_empty() || !minor.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// Where CPython lives in a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Interpreter {
    /// A mapped `libpython3.X.so*`, with the version its name gives.
    Shared {
        path: PathBuf,
        soname_version: (u8, u8),
        mappings: Vec<Mapping>,
    },
    /// No libpython: the executable itself may be a static interpreter; its symbols decide.
    Executable {
        path: PathBuf,
        mappings: Vec<Mapping>,
    },
}

/// Picks the interpreter's file from a maps listing: a mapped libpython first (the only
/// one — two different libpythons in one process is not a layout to guess at), else the
/// executable's own mappings.
pub fn find_interpreter(maps: &str, exe: Option<&Path>) -> Result<Interpreter, MapsProblem> {
    let mappings: Vec<Mapping> = maps.lines().filter_map(parse_line).collect();
    let mut libraries: Vec<(&Path, (u8, u8))> = mappings
        .iter()
        .filter_map(|m| libpython_version(&m.path).map(|v| (m.path.as_path(), v)))
        .collect();
    libraries.sort_unstable();
    libraries.dedup();
    match libraries.as_slice() {
        [] => {}
        [(path, version)] => {
            let path = path.to_path_buf();
            let mine = mappings
                .iter()
                .filter(|m| m.path == path)
                .cloned()
                .collect();
            return Ok(Interpreter::Shared {
                path,
                soname_version: *version,
                mappings: mine,
            });
        }
        _ => return Err(MapsProblem::SeveralLibpythons),
    }
    let exe = exe.ok_or(MapsProblem::NoExecutable)?;
    let mine: Vec<Mapping> = mappings.iter().filter(|m| m.path == exe).cloned().collect();
    if mine.is_empty() {
        return Err(MapsProblem::NoExecutable);
    }
    Ok(Interpreter::Executable {
        path: exe.to_path_buf(),
        mappings: mine,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapsProblem {
    SeveralLibpythons,
    NoExecutable,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recorded from a pyenv 3.13.0 process on this machine kind (addresses shortened).
    const MAPS_313: &str = "\
55d0c8a00000-55d0c8a01000 r--p 00000000 08:01 1311 /root/.pyenv/versions/3.13.0/bin/python3.13
55d0c9f3c000-55d0ca0a1000 rw-p 00000000 00:00 0 [heap]
7f3a51c00000-7f3a51d00000 r--p 00000000 08:01 2203 /root/.pyenv/versions/3.13.0/lib/libpython3.13.so.1.0
7f3a51d00000-7f3a52000000 r-xp 00100000 08:01 2203 /root/.pyenv/versions/3.13.0/lib/libpython3.13.so.1.0
7f3a52400000-7f3a52500000 rw-p 00600000 08:01 2203 /root/.pyenv/versions/3.13.0/lib/libpython3.13.so.1.0
7f3a52600000-7f3a52800000 rw-p 00000000 00:00 0
7ffd1f0e5000-7ffd1f106000 rw-p 00000000 00:00 0 [stack]
";

    #[test]
    fn parses_file_mappings_and_skips_the_rest() {
        let m = parse_line("7f3a51d00000-7f3a52000000 r-xp 00100000 08:01 2203 /a b/libx.so")
            .expect("a file mapping");
        assert_eq!(
            (m.start, m.end, m.file_offset),
            (0x7f3a51d00000, 0x7f3a52000000, 0x100000)
        );
        assert_eq!(m.path, PathBuf::from("/a b/libx.so"));
        assert_eq!(
            parse_line("7f3a52600000-7f3a52800000 rw-p 00000000 00:00 0"),
            None
        );
        assert_eq!(
            parse_line("55d0c9f3c000-55d0ca0a1000 rw-p 00000000 00:00 0 [heap]"),
            None
        );
        assert_eq!(
            parse_line("1000-2000 r--p 00000000 08:01 7 /tmp/x.so (deleted)"),
            None
        );
        assert_eq!(parse_line("zz-2000 r--p 00000000 08:01 7 /tmp/x.so"), None);
        assert_eq!(parse_line("1000-2000 r--p"), None);
    }

    #[test]
    fn version_comes_from_the_soname() {
        let v = |p: &str| libpython_version(Path::new(p));
        assert_eq!(v("/usr/lib/libpython3.12.so.1.0"), Some((3, 12)));
        assert_eq!(v("/x/libpython3.13.so"), Some((3, 13)));
        assert_eq!(v("/x/libpython3.14.so.1.0"), Some((3, 14)));
        assert_eq!(
            v("/x/libpython3.so"),
            None,
            "the stable-ABI shim names no minor"
        );
        assert_eq!(
            v("/x/libpython3.13t.so.1.0"),
            None,
            "free-threaded layout differs"
        );
        assert_eq!(v("/x/libpython3.13d.so.1.0"), None, "debug layout differs");
        assert_eq!(v("/x/libpython3.13.sox"), None);
        assert_eq!(v("/x/python3.13"), None);
    }

    #[test]
    fn finds_the_shared_library_and_its_mappings() {
        let exe = Path::new("/root/.pyenv/versions/3.13.0/bin/python3.13");
        match find_interpreter(MAPS_313, Some(exe)) {
            Ok(Interpreter::Shared {
                path,
                soname_version,
                mappings,
            }) => {
                assert!(path.ends_with("libpython3.13.so.1.0"));
                assert_eq!(soname_version, (3, 13));
                assert_eq!(mappings.len(), 3);
                assert_eq!(mappings[0].start, 0x7f3a51c00000);
            }
            other => panic!("expected the shared library, got {other:?}"),
        }
    }

    #[test]
    fn without_libpython_the_executable_is_the_candidate() {
        let maps = "55d0c8a00000-55d0c8a01000 r--p 00000000 08:01 1 /usr/bin/python3\n";
        let exe = Path::new("/usr/bin/python3");
        assert!(matches!(
            find_interpreter(maps, Some(exe)),
            Ok(Interpreter::Executable { mappings, .. }) if mappings.len() == 1
        ));
        assert_eq!(find_interpreter(maps, None), Err(MapsProblem::NoExecutable));
        assert_eq!(
            find_interpreter(maps, Some(Path::new("/bin/sh"))),
            Err(MapsProblem::NoExecutable)
        );
    }

    #[test]
    fn two_different_libpythons_are_refused() {
        let maps = "1000-2000 r--p 00000000 08:01 1 /a/libpython3.12.so.1.0\n\
                    3000-4000 r--p 00000000 08:01 2 /b/libpython3.13.so.1.0\n";
        assert_eq!(
            find_interpreter(maps, None),
            Err(MapsProblem::SeveralLibpythons)
        );
    }
}
