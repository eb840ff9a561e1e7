//! The field layout of a tracepoint record, from its tracefs `format` file, and the layout
//! the kernel programs are told at load time.
//!
//! A tracepoint's record layout is not a stable ABI: `sched_process_fork` moved `child_pid`
//! from 44 to 20 when its command names became `__data_loc` strings, and
//! `sched_process_exit` gained `group_dead` only recently. Rust eBPF has no CO-RE, so the
//! programs read the offsets they were given, and user space reads them here from the files
//! the kernel itself publishes. Pure text in, layout out: the I/O is the caller's.

use std::fmt;

use tracer_abi::{FIELD_ABSENT, TracepointLayout};

/// One `field:` line of a format file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    pub name: String,
    /// The C declaration without the name (`pid_t`, `char[16]`, `__data_loc char[]`).
    pub c_type: String,
    pub offset: u32,
    pub size: u32,
    pub signed: bool,
}

/// The fields of one tracepoint record, in file order (common fields included).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Format {
    pub fields: Vec<Field>,
}

/// Why a format file could not be read as a record layout.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("line {line} ({text:?}) is not `field:TYPE NAME; offset:N; size:N; signed:N;`")]
    MalformedField { line: usize, text: String },
    #[error("it lists no fields")]
    NoFields,
}

impl Format {
    /// Parses the text of `<tracefs>/events/<category>/<name>/format`.
    pub fn parse(text: &str) -> Result<Self, FormatError> {
        let mut fields = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if !line.starts_with("field:") {
                continue;
            }
            let malformed = || FormatError::MalformedField {
                line: index + 1,
                text: line.to_string(),
            };
            fields.push(parse_field(line).ok_or_else(malformed)?);
        }
        if fields.is_empty() {
            return Err(FormatError::NoFields);
        }
        Ok(Self { fields })
    }

    pub fn field(&self, name: &str) -> Option<&Field> {
        self.fields.iter().find(|field| field.name == name)
    }
}

/// `field:pid_t child_pid;\toffset:20;\tsize:4;\tsigned:1;`
fn parse_field(line: &str) -> Option<Field> {
    let mut parts = line.split(';').map(str::trim);
    let declaration = parts.next()?.strip_prefix("field:")?.trim();
    let (c_type, name) = split_declaration(declaration)?;
    let (mut offset, mut size, mut signed) = (None, None, false);
    for part in parts.filter(|part| !part.is_empty()) {
        let (key, value) = part.split_once(':')?;
        let value: u32 = value.trim().parse().ok()?;
        match key.trim() {
            "offset" => offset = Some(value),
            "size" => size = Some(value),
            "signed" => signed = value != 0,
            _ => {}
        }
    }
    Some(Field {
        name,
        c_type,
        offset: offset?,
        size: size?,
        signed,
    })
}

/// `char comm[16]` → (`char[16]`, `comm`); `__data_loc char[] parent_comm` →
/// (`__data_loc char[]`, `parent_comm`).
fn split_declaration(declaration: &str) -> Option<(String, String)> {
    let (before, last) = match declaration.rsplit_once(char::is_whitespace) {
        Some((before, last)) => (before.trim(), last),
        None => return None,
    };
    let (name, array) = match last.find('[') {
        Some(at) => (&last[..at], &last[at..]),
        None => (last, ""),
    };
    let valid = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    valid.then(|| (format!("{before}{array}"), name.to_string()))
}

/// Why a tracepoint's layout cannot be used by the kernel programs; names the tracepoint
/// and the field, and says what the programs need.
#[derive(Debug, PartialEq, Eq)]
pub struct LayoutError {
    /// `category/name`.
    pub tracepoint: String,
    /// The field, or empty when the whole file is at fault.
    pub field: String,
    pub problem: String,
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "tracepoint {}: {}", self.tracepoint, self.problem)
        } else {
            write!(
                f,
                "tracepoint {}: field `{}` {}",
                self.tracepoint, self.field, self.problem
            )
        }
    }
}

impl std::error::Error for LayoutError {}

pub const NEW_TASK: &str = "task/task_newtask";
pub const PROCESS_EXIT: &str = "sched/sched_process_exit";

fn layout_error(tracepoint: &str, field: &str, problem: impl Into<String>) -> LayoutError {
    LayoutError {
        tracepoint: tracepoint.to_string(),
        field: field.to_string(),
        problem: problem.into(),
    }
}

/// Parses one format file, naming the tracepoint when it cannot be read.
pub fn parse_format(tracepoint: &str, text: &str) -> Result<Format, LayoutError> {
    Format::parse(text).map_err(|error| layout_error(tracepoint, "", format!("format: {error}")))
}

/// A field the programs read, checked for one of the sizes they know how to read.
fn required(
    tracepoint: &str,
    format: &Format,
    name: &str,
    sizes: &[u32],
) -> Result<Field, LayoutError> {
    let field = format.field(name).ok_or_else(|| {
        layout_error(
            tracepoint,
            name,
            "is missing: gym-tracer cannot follow processes on this kernel",
        )
    })?;
    if !sizes.contains(&field.size) {
        return Err(layout_error(
            tracepoint,
            name,
            format!(
                "is {} bytes at offset {}; gym-tracer reads it as {sizes:?} bytes",
                field.size, field.offset
            ),
        ));
    }
    Ok(field.clone())
}

/// The layout the fork and exit programs read, from the formats of `task/task_newtask` and
/// `sched/sched_process_exit`.
///
/// `group_dead` (the last thread of the process exits) is absent before Linux 6.x's
/// addition of it to `sched_process_exit`; without it the exit program takes the exit of the
/// thread-group leader (pid == tgid) as the process's. That is the process's end in every
/// case but two rare ones: a leader that calls `pthread_exit` while other threads run (the
/// process is reported gone early), and an `execve` from a non-leader thread (the old
/// leader's exit is reported although the process lives on under the same pid).
pub fn layout_from_formats(new_task: &str, exit: &str) -> Result<TracepointLayout, LayoutError> {
    let new_task = parse_format(NEW_TASK, new_task)?;
    let exit = parse_format(PROCESS_EXIT, exit)?;
    let pid = required(NEW_TASK, &new_task, "pid", &[4])?;
    let clone_flags = required(NEW_TASK, &new_task, "clone_flags", &[4, 8])?;
    let group_dead = match exit.field("group_dead") {
        None => FIELD_ABSENT,
        Some(_) => required(PROCESS_EXIT, &exit, "group_dead", &[1])?.offset,
    };
    Ok(TracepointLayout {
        new_task_pid: pid.offset,
        new_task_clone_flags: clone_flags.offset,
        new_task_clone_flags_size: clone_flags.size,
        exit_group_dead: group_dead,
    })
}

/// The syscall programs read arguments as 8-byte slots from offset 16 and the return value
/// at 16 (`struct trace_event_raw_sys_enter`/`_sys_exit`: the common header, `int
/// __syscall_nr`, padding); checks that `format` is that layout.
pub fn check_syscall_layout(tracepoint: &str, format: &Format) -> Result<(), LayoutError> {
    let nr = format.field("__syscall_nr");
    if nr.is_none_or(|nr| nr.offset != 8) {
        return Err(layout_error(
            tracepoint,
            "__syscall_nr",
            "is not at offset 8: not a syscall tracepoint layout gym-tracer knows",
        ));
    }
    let after_nr = format
        .fields
        .iter()
        .skip_while(|field| field.name != "__syscall_nr")
        .skip(1);
    for (slot, field) in after_nr.enumerate() {
        let offset = 16 + 8 * slot as u32;
        if field.offset != offset || field.size != 8 {
            return Err(layout_error(
                tracepoint,
                &field.name,
                format!(
                    "is {} bytes at offset {}; gym-tracer reads it as 8 bytes at {offset}",
                    field.size, field.offset
                ),
            ));
        }
    }
    Ok(())
}

/// One line for `doctor`: where the programs read what.
pub fn describe(layout: &TracepointLayout) -> String {
    let exit = if layout.exit_group_dead == FIELD_ABSENT {
        "sched_process_exit has no group_dead: a process ends with its leader thread".to_string()
    } else {
        format!("sched_process_exit group_dead@{}", layout.exit_group_dead)
    };
    format!(
        "task_newtask pid@{} clone_flags@{} ({} bytes), {exit}",
        layout.new_task_pid, layout.new_task_clone_flags, layout.new_task_clone_flags_size
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sched_process_fork` of this machine's 6.18 kernel (`__data_loc` command names).
    const FORK_6_18: &str = "name: sched_process_fork
ID: 366
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:__data_loc char[] parent_comm;\toffset:8;\tsize:4;\tsigned:0;
\tfield:pid_t parent_pid;\toffset:12;\tsize:4;\tsigned:1;
\tfield:__data_loc char[] child_comm;\toffset:16;\tsize:4;\tsigned:0;
\tfield:pid_t child_pid;\toffset:20;\tsize:4;\tsigned:1;

print fmt: \"comm=%s pid=%d child_comm=%s child_pid=%d\", __get_str(parent_comm), REC->parent_pid, __get_str(child_comm), REC->child_pid
";

    /// `sched_process_fork` as kernels before the `__data_loc` change have it.
    const FORK_CLASSIC: &str = "name: sched_process_fork
ID: 312
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:char parent_comm[16];\toffset:8;\tsize:16;\tsigned:0;
\tfield:pid_t parent_pid;\toffset:24;\tsize:4;\tsigned:1;
\tfield:char child_comm[16];\toffset:28;\tsize:16;\tsigned:0;
\tfield:pid_t child_pid;\toffset:44;\tsize:4;\tsigned:1;

print fmt: \"comm=%s pid=%d child_comm=%s child_pid=%d\", REC->parent_comm, REC->parent_pid, REC->child_comm, REC->child_pid
";

    /// `sched_process_exit` of this machine's 6.18 kernel.
    const EXIT_6_18: &str = "name: sched_process_exit
ID: 369
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;
\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;
\tfield:int prio;\toffset:28;\tsize:4;\tsigned:1;
\tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;

print fmt: \"comm=%s pid=%d prio=%d group_dead=%s\", REC->comm, REC->pid, REC->prio, REC->group_dead ? \"true\" : \"false\"
";

    /// `sched_process_exit` before `group_dead`.
    const EXIT_CLASSIC: &str = "name: sched_process_exit
ID: 309
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;
\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;
\tfield:int prio;\toffset:28;\tsize:4;\tsigned:1;

print fmt: \"comm=%s pid=%d prio=%d\", REC->comm, REC->pid, REC->prio
";

    /// `task_newtask` of this machine's 6.18 kernel.
    const NEW_TASK_6_18: &str = "name: task_newtask
ID: 205
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:pid_t pid;\toffset:8;\tsize:4;\tsigned:1;
\tfield:char comm[16];\toffset:12;\tsize:16;\tsigned:0;
\tfield:u64 clone_flags;\toffset:32;\tsize:8;\tsigned:0;
\tfield:short oom_score_adj;\toffset:40;\tsize:2;\tsigned:1;

print fmt: \"pid=%d comm=%s clone_flags=%llx oom_score_adj=%hd\", REC->pid, REC->comm, REC->clone_flags, REC->oom_score_adj
";

    /// `sys_enter_connect` and `sys_exit_read` of this machine's 6.18 kernel.
    const ENTER_CONNECT: &str = "name: sys_enter_connect
ID: 1570
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:int __syscall_nr;\toffset:8;\tsize:4;\tsigned:1;
\tfield:int fd;\toffset:16;\tsize:8;\tsigned:0;
\tfield:struct sockaddr * uservaddr;\toffset:24;\tsize:8;\tsigned:0;
\tfield:int addrlen;\toffset:32;\tsize:8;\tsigned:0;
";
    const EXIT_READ: &str = "name: sys_exit_read
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:int __syscall_nr;\toffset:8;\tsize:4;\tsigned:1;
\tfield:long ret;\toffset:16;\tsize:8;\tsigned:1;
";

    fn field(format: &Format, name: &str) -> (u32, u32, bool) {
        let field = format.field(name).unwrap();
        (field.offset, field.size, field.signed)
    }

    #[test]
    fn parses_both_fork_layouts() {
        let new = Format::parse(FORK_6_18).unwrap();
        assert_eq!(new.fields.len(), 8);
        assert_eq!(field(&new, "child_pid"), (20, 4, true));
        assert_eq!(field(&new, "parent_comm"), (8, 4, false));
        assert_eq!(new.field("child_comm").unwrap().c_type, "__data_loc char[]");
        let classic = Format::parse(FORK_CLASSIC).unwrap();
        assert_eq!(field(&classic, "parent_comm"), (8, 16, false));
        assert_eq!(classic.field("parent_comm").unwrap().c_type, "char[16]");
        assert_eq!(field(&classic, "parent_pid"), (24, 4, true));
        assert_eq!(field(&classic, "child_comm"), (28, 16, false));
        assert_eq!(field(&classic, "child_pid"), (44, 4, true));
        assert_eq!(field(&classic, "common_pid"), (4, 4, true));
    }

    #[test]
    fn parses_both_exit_layouts() {
        let new = Format::parse(EXIT_6_18).unwrap();
        assert_eq!(field(&new, "group_dead"), (32, 1, false));
        assert_eq!(new.field("group_dead").unwrap().c_type, "bool");
        let classic = Format::parse(EXIT_CLASSIC).unwrap();
        assert_eq!(field(&classic, "pid"), (24, 4, true));
        assert!(classic.field("group_dead").is_none());
    }

    #[test]
    fn this_kernels_layout_reads_group_dead() {
        let layout = layout_from_formats(NEW_TASK_6_18, EXIT_6_18).unwrap();
        assert_eq!(
            layout,
            TracepointLayout {
                new_task_pid: 8,
                new_task_clone_flags: 32,
                new_task_clone_flags_size: 8,
                exit_group_dead: 32,
            }
        );
        assert_eq!(
            describe(&layout),
            "task_newtask pid@8 clone_flags@32 (8 bytes), sched_process_exit group_dead@32"
        );
    }

    #[test]
    fn without_group_dead_the_exit_falls_back_to_the_leader() {
        let layout = layout_from_formats(NEW_TASK_6_18, EXIT_CLASSIC).unwrap();
        assert_eq!(layout.exit_group_dead, FIELD_ABSENT);
        assert_eq!(layout.new_task_pid, 8);
        assert!(describe(&layout).contains("no group_dead"));
    }

    #[test]
    fn unusable_layouts_are_refused_by_tracepoint_and_field() {
        let no_flags = NEW_TASK_6_18.replace("clone_flags", "flags");
        let error = layout_from_formats(&no_flags, EXIT_6_18).unwrap_err();
        assert_eq!(error.tracepoint, NEW_TASK);
        assert_eq!(error.field, "clone_flags");
        assert!(
            error
                .to_string()
                .starts_with("tracepoint task/task_newtask: field `clone_flags` is missing")
        );

        let wide_pid = NEW_TASK_6_18.replace("offset:8;\tsize:4;", "offset:8;\tsize:8;");
        let error = layout_from_formats(&wide_pid, EXIT_6_18).unwrap_err();
        assert_eq!(error.field, "pid");
        assert!(error.problem.contains("8 bytes at offset 8"), "{error}");

        let wide_group_dead = EXIT_6_18.replace("offset:32;\tsize:1;", "offset:32;\tsize:4;");
        let error = layout_from_formats(NEW_TASK_6_18, &wide_group_dead).unwrap_err();
        assert_eq!(
            (error.tracepoint.as_str(), error.field.as_str()),
            (PROCESS_EXIT, "group_dead")
        );
    }

    #[test]
    fn malformed_format_files_are_errors() {
        assert_eq!(Format::parse(""), Err(FormatError::NoFields));
        assert_eq!(
            Format::parse("name: x\nformat:\n"),
            Err(FormatError::NoFields)
        );
        let no_offset = "\tfield:int common_pid;\tsize:4;\tsigned:1;";
        assert!(matches!(
            Format::parse(no_offset),
            Err(FormatError::MalformedField { line: 1, .. })
        ));
        let bad_number = FORK_6_18.replace("offset:20;", "offset:twenty;");
        assert!(matches!(
            Format::parse(&bad_number),
            Err(FormatError::MalformedField { line: 12, .. })
        ));
        let no_name = "\tfield:int;\toffset:4;\tsize:4;\tsigned:1;";
        assert!(Format::parse(no_name).is_err());
        let error = layout_from_formats("garbage", EXIT_6_18).unwrap_err();
        assert_eq!(error.tracepoint, NEW_TASK);
        assert!(error.to_string().contains("lists no fields"), "{error}");
    }

    #[test]
    fn syscall_layouts_are_checked_slot_by_slot() {
        let connect = Format::parse(ENTER_CONNECT).unwrap();
        assert_eq!(
            check_syscall_layout("syscalls/sys_enter_connect", &connect),
            Ok(())
        );
        let read = Format::parse(EXIT_READ).unwrap();
        assert_eq!(
            check_syscall_layout("syscalls/sys_exit_read", &read),
            Ok(())
        );
        let moved = Format::parse(&ENTER_CONNECT.replace("offset:24;", "offset:20;")).unwrap();
        let error = check_syscall_layout("syscalls/sys_enter_connect", &moved).unwrap_err();
        assert_eq!(error.field, "uservaddr");
        let not_syscall = Format::parse(FORK_6_18).unwrap();
        let error = check_syscall_layout("sched/sched_process_fork", &not_syscall).unwrap_err();
        assert_eq!(error.field, "__syscall_nr");
    }
}
