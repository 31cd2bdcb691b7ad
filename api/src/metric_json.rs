//! Metric values in JSON. A diverging run reports NaN or an infinity, which JSON numbers
//! cannot hold (serde_json would write `null`, Python's `json` an invalid `NaN`): a
//! finite value is a JSON number, NaN the string [`NAN`], +∞ [`INFINITY`] and −∞
//! [`NEG_INFINITY`] (protobuf's JSON mapping of a double). Every JSON body with metrics
//! uses this form: the rank-local `POST /v1/progress` ([`crate::rank_local::ProgressReport`])
//! and the REST mirror's `RankStatus.metrics`, `JobSummary.metrics` and
//! `ProgressSample.metrics`. People see them as [`display`] writes them: `nan`, `inf`,
//! `-inf`.
//!
//! Use it as a field's `#[serde(with = "cumulus_api::metric_json")]` on any map of metric
//! names to `f64`.

use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserializer, Serializer};

/// JSON spelling of NaN.
pub const NAN: &str = "NaN";
/// JSON spelling of +∞.
pub const INFINITY: &str = "Infinity";
/// JSON spelling of −∞.
pub const NEG_INFINITY: &str = "-Infinity";

/// The JSON string of a non-finite value, `None` for a finite one (a JSON number).
pub fn non_finite_spelling(value: f64) -> Option<&'static str> {
    if value.is_nan() {
        Some(NAN)
    } else if value == f64::INFINITY {
        Some(INFINITY)
    } else if value == f64::NEG_INFINITY {
        Some(NEG_INFINITY)
    } else {
        None
    }
}

/// The value a JSON string stands for: [`NAN`], [`INFINITY`] or [`NEG_INFINITY`]
/// exactly; `None` for any other string.
pub fn parse_spelling(text: &str) -> Option<f64> {
    match text {
        NAN => Some(f64::NAN),
        INFINITY => Some(f64::INFINITY),
        NEG_INFINITY => Some(f64::NEG_INFINITY),
        _ => None,
    }
}

/// A metric value as people read it: `nan`, `inf`, `-inf`, else `{value:.decimals$}`.
pub fn display(value: f64, decimals: usize) -> String {
    if value.is_nan() {
        "nan".into()
    } else if value.is_infinite() {
        if value > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{value:.decimals$}")
    }
}

struct Value(f64);

impl serde::Serialize for Value {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match non_finite_spelling(self.0) {
            Some(text) => s.serialize_str(text),
            None => s.serialize_f64(self.0),
        }
    }
}

impl<'de> serde::Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Value;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    "a number or one of \"{NAN}\", \"{INFINITY}\", \"{NEG_INFINITY}\""
                )
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
                Ok(Value(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
                Ok(Value(v as f64))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
                Ok(Value(v as f64))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
                parse_spelling(v)
                    .map(Value)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
            }
        }
        d.deserialize_any(V)
    }
}

/// Writes a map of metric names to values, non-finite values as their strings.
///
/// # Errors
/// The serializer's.
pub fn serialize<'a, M, S>(metrics: &'a M, s: S) -> Result<S::Ok, S::Error>
where
    &'a M: IntoIterator<Item = (&'a String, &'a f64)>,
    S: Serializer,
{
    let entries: Vec<(&String, &f64)> = metrics.into_iter().collect();
    let mut map = s.serialize_map(Some(entries.len()))?;
    for (k, v) in entries {
        map.serialize_entry(k, &Value(*v))?;
    }
    map.end()
}

/// Reads a map of metric names to values: numbers, or the strings of the non-finite
/// values (anything else is an error naming what is accepted). `null` is an empty map.
///
/// # Errors
/// A value that is neither a number nor one of [`NAN`], [`INFINITY`], [`NEG_INFINITY`].
pub fn deserialize<'de, M, D>(d: D) -> Result<M, D::Error>
where
    M: Default + FromIterator<(String, f64)>,
    D: Deserializer<'de>,
{
    struct MapV<M>(std::marker::PhantomData<M>);
    impl<'de, M: Default + FromIterator<(String, f64)>> Visitor<'de> for MapV<M> {
        type Value = M;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a map of metric names to values")
        }
        fn visit_unit<E: de::Error>(self) -> Result<M, E> {
            Ok(M::default())
        }
        fn visit_none<E: de::Error>(self) -> Result<M, E> {
            Ok(M::default())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<M, A::Error> {
            let mut out = Vec::new();
            while let Some((k, v)) = a.next_entry::<String, Value>()? {
                out.push((k, v.0));
            }
            Ok(out.into_iter().collect())
        }
    }
    d.deserialize_any(MapV(std::marker::PhantomData))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Serialize};

    #[derive(Debug, Default, Serialize, Deserialize)]
    struct Body {
        #[serde(with = "super", default)]
        metrics: BTreeMap<String, f64>,
    }

    #[test]
    fn non_finite_values_round_trip_as_strings_and_finite_ones_as_numbers() {
        let body = Body {
            metrics: [
                ("a".to_string(), 0.5),
                ("b".to_string(), f64::NAN),
                ("c".to_string(), f64::INFINITY),
                ("d".to_string(), f64::NEG_INFINITY),
            ]
            .into(),
        };
        let text = serde_json::to_string(&body).expect("serializes");
        assert_eq!(
            text,
            r#"{"metrics":{"a":0.5,"b":"NaN","c":"Infinity","d":"-Infinity"}}"#
        );
        let back: Body = serde_json::from_str(&text).expect("parses");
        assert_eq!(back.metrics["a"], 0.5);
        assert!(back.metrics["b"].is_nan());
        assert_eq!(back.metrics["c"], f64::INFINITY);
        assert_eq!(back.metrics["d"], f64::NEG_INFINITY);
        let ints: Body = serde_json::from_str(r#"{"metrics":{"n":3}}"#).expect("an int");
        assert_eq!(ints.metrics["n"], 3.0);
        let none: Body = serde_json::from_str(r#"{"metrics":null}"#).expect("null");
        assert!(none.metrics.is_empty());
        let missing: Body = serde_json::from_str("{}").expect("absent");
        assert!(missing.metrics.is_empty());
    }

    #[test]
    fn other_strings_and_types_are_refused_with_what_is_accepted() {
        for bad in [
            r#"{"metrics":{"x":"nan"}}"#,
            r#"{"metrics":{"x":"1.5"}}"#,
            r#"{"metrics":{"x":true}}"#,
            r#"{"metrics":{"x":[1]}}"#,
        ] {
            let e = serde_json::from_str::<Body>(bad).expect_err(bad);
            assert!(e.to_string().contains("\"NaN\""), "{bad}: {e}");
        }
    }

    #[test]
    fn people_read_nan_inf_and_minus_inf() {
        assert_eq!(super::display(f64::NAN, 4), "nan");
        assert_eq!(super::display(f64::INFINITY, 4), "inf");
        assert_eq!(super::display(f64::NEG_INFINITY, 4), "-inf");
        assert_eq!(super::display(0.25, 4), "0.2500");
    }
}
