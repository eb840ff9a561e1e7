//! Counters a stage owns. Each stage declares its own with [`counters!`], which generates the
//! field names together with the fields, so the `stopped.` line, `/metrics`, the summary file
//! and the self-telemetry can never name a counter that does not exist or miss one that does.

/// Visits a stage's counters in their declared order.
pub trait Counters {
    fn for_each(&self, visit: &mut dyn FnMut(&'static str, u64));
}

/// `counters! { /// doc  pub struct ReassemblyCounters { /// doc  parse_not_http, ... } }`:
/// a struct of `u64` fields (Default, Copy, PartialEq) and its [`Counters`] impl, whose names
/// are the field names.
macro_rules! counters {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$field_meta:meta])* $field:ident ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name {
            $( $(#[$field_meta])* pub $field: u64, )*
        }

        impl $crate::model::counters::Counters for $name {
            fn for_each(&self, visit: &mut dyn FnMut(&'static str, u64)) {
                $( visit(stringify!($field), self.$field); )*
            }
        }
    };
}
pub(crate) use counters;

#[cfg(test)]
mod tests {
    use super::*;

    counters! {
        /// Two counters.
        pub struct Sample {
            /// The first.
            first,
            second,
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
}
