//! Counters a stage owns. Each stage declares its own with [`counters!`], which generates the
//! field names together with the fields, so the exit summary, `/metrics`, the summary file
//! and the self-telemetry can never name a counter that does not exist or miss one that does.
//! Each counter's doc comment is also what `docs/troubleshooting.md` and the exit summary say
//! about it: written once, beside the field.

/// Visits a stage's counters in their declared order.
pub trait Counters {
    fn for_each(&self, visit: &mut dyn FnMut(&'static str, u64));
}

/// What a counter moving means to the person reading the exit summary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CounterClass {
    /// Work done: what was traced and exported.
    Traced,
    /// Data the output lacks: records, requests, spans or edges lost or dropped.
    Lost,
    /// Parents left out because the evidence did not decide them, by reason.
    Undecided,
    /// Parents drawn, by the evidence that decided them.
    Decided,
    /// Worth knowing, not a loss (what was skipped by design, high-water marks, retries
    /// that succeeded).
    Note,
}

/// A counter as people read about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterInfo {
    pub name: &'static str,
    pub class: CounterClass,
    /// The field's doc comment: its first sentence says what it counts, the rest when it
    /// moves and what to do.
    pub doc: &'static str,
}

impl CounterInfo {
    /// The doc comment as one paragraph.
    pub fn text(&self) -> String {
        self.doc.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    /// The first sentence: what it counts, for one line of the exit summary.
    pub fn summary(&self) -> String {
        let text = self.text();
        match text.find(". ") {
            Some(end) => text[..end].to_owned(),
            None => text.trim_end_matches('.').to_owned(),
        }
    }
}

/// `counters! { /// doc  pub struct ReassemblyCounters { /// doc  lost parse_not_http, ... } }`:
/// a struct of `u64` fields (Default, Copy, PartialEq), its [`Counters`] impl, whose names
/// are the field names, and `INFO`, each field's [`CounterClass`] (`traced`, `lost`,
/// `undecided`, `decided`, `note`) and doc comment.
macro_rules! counters {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[doc = $doc:literal])* $class:ident $field:ident ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name {
            $( $(#[doc = $doc])* pub $field: u64, )*
        }

        impl $name {
            /// Each counter's class and doc comment, in declared order.
            pub const INFO: &'static [$crate::model::counters::CounterInfo] = &[
                $( $crate::model::counters::CounterInfo {
                    name: stringify!($field),
                    class: $crate::model::counters::counters!(@class $class),
                    doc: concat!($($doc, "\n",)* ""),
                }, )*
            ];
        }

        impl $crate::model::counters::Counters for $name {
            fn for_each(&self, visit: &mut dyn FnMut(&'static str, u64)) {
                $( visit(stringify!($field), self.$field); )*
            }
        }
    };
    (@class traced) => { $crate::model::counters::CounterClass::Traced };
    (@class lost) => { $crate::model::counters::CounterClass::Lost };
    (@class undecided) => { $crate::model::counters::CounterClass::Undecided };
    (@class decided) => { $crate::model::counters::CounterClass::Decided };
    (@class note) => { $crate::model::counters::CounterClass::Note };
}
pub(crate) use counters;

#[cfg(test)]
mod tests {
    use super::*;

    counters! {
        /// Two counters.
        pub struct Sample {
            /// The first thing. Raise nothing.
            traced first,
            /// The second.
            lost second,
        }
    }

    #[test]
    fn names_are_the_fields_in_order() {
        let sample = Sample {
            first: 1,
            second: 2,
        };
        let mut seen = Vec::new();
        sample.for_each(&mut |name, value| seen.push((name, value)));
        assert_eq!(seen, [("first", 1), ("second", 2)]);
    }

    #[test]
    fn info_carries_class_and_doc() {
        assert_eq!(Sample::INFO[0].name, "first");
        assert_eq!(Sample::INFO[0].class, CounterClass::Traced);
        assert_eq!(Sample::INFO[0].summary(), "The first thing");
        assert_eq!(Sample::INFO[0].text(), "The first thing. Raise nothing.");
        assert_eq!(Sample::INFO[1].class, CounterClass::Lost);
        assert_eq!(Sample::INFO[1].summary(), "The second");
    }
}
