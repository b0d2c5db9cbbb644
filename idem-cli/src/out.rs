//! What a command prints on stdout: `name: value` lines, or with `--json` one JSON object
//! holding the same names and values (numbers as numbers, a missing value as `null`),
//! printed when the command ends. Progress and diagnostics go to stderr either way.

use std::sync::OnceLock;

use serde_json::{Map, Value};

/// Set once, from `--json`, before any command runs.
static JSON: OnceLock<bool> = OnceLock::new();

/// Whether results are printed as one JSON object (`--json`).
pub(crate) fn set_json(json: bool) {
    let _ = JSON.set(json);
}

/// Whether `--json` was given.
pub(crate) fn json() -> bool {
    JSON.get().copied().unwrap_or(false)
}

/// A value as its `name: value` line shows it: a string bare, `null` as `-`.
pub(crate) fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
}

/// The results of one command: each [`field`](Self::field) is printed at once as a line,
/// or kept for the JSON object that [`finish`](Self::finish) prints.
#[derive(Debug, Default)]
pub(crate) struct Out {
    json: bool,
    fields: Map<String, Value>,
}

impl Out {
    /// Results in the form `--json` asked for.
    pub(crate) fn new() -> Self {
        Self {
            json: json(),
            fields: Map::new(),
        }
    }

    /// One result: a line now, or a member of the object.
    pub(crate) fn field(&mut self, name: &str, value: impl Into<Value>) {
        let value = value.into();
        if self.json {
            self.fields.insert(name.to_owned(), value);
        } else {
            println!("{name}: {}", text(&value));
        }
    }

    /// A measured number: `decimals` places in its line, the same rounding in the object.
    pub(crate) fn measure(&mut self, name: &str, value: f64, decimals: usize) {
        if self.json {
            let scale = 10f64.powi(i32::try_from(decimals).unwrap_or(0));
            let rounded = (value * scale).round() / scale;
            let v = if decimals == 0 && rounded.abs() < 9.0e15 {
                // A whole number: an integer in the object.
                Value::from(rounded as i64)
            } else {
                Value::from(rounded)
            };
            self.fields.insert(name.to_owned(), v);
        } else {
            println!("{name}: {value:.decimals$}");
        }
    }

    /// A structured result that only the JSON object carries (its lines, if any, are
    /// the caller's).
    pub(crate) fn json_only(&mut self, name: &str, value: Value) {
        if self.json {
            self.fields.insert(name.to_owned(), value);
        }
    }

    /// Whether the results go into a JSON object.
    pub(crate) fn is_json(&self) -> bool {
        self.json
    }

    /// Prints the JSON object (nothing more in the line form).
    pub(crate) fn finish(self) {
        if self.json {
            println!("{}", Value::Object(self.fields));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_reads_the_same_in_both_forms() {
        assert_eq!(text(&Value::from("x y")), "x y");
        assert_eq!(text(&Value::from(12u64)), "12");
        assert_eq!(text(&Value::from(true)), "true");
        assert_eq!(text(&Value::Null), "-");
        let mut out = Out {
            json: true,
            fields: Map::new(),
        };
        out.field("claims", 3u64);
        out.field("award_id", Value::Null);
        out.json_only("events", Value::Array(vec![]));
        out.measure("seconds", 1.23456, 3);
        out.measure("rate", 99.6, 0);
        assert_eq!(
            Value::Object(out.fields).to_string(),
            r#"{"award_id":null,"claims":3,"events":[],"rate":100,"seconds":1.235}"#
        );
    }
}
