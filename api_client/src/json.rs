//! JSON objects with their keys in a fixed order: upstream's `ch-remote`
//! serializes its structs field by field, and the request bodies here are
//! written in the same order so the bytes on the wire match.

use std::fmt;

/// One JSON value of a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Json {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// An unsigned integer.
    Uint(u64),
    /// A string, escaped on output.
    Str(String),
    /// An array.
    Array(Vec<Json>),
    /// An object, keys in the order given.
    Object(Object),
}

/// A JSON object whose keys keep the order they were added in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Object(Vec<(&'static str, Json)>);

impl Object {
    /// An empty object.
    pub fn new() -> Self {
        Object::default()
    }

    /// Adds `key` (keys are fixed names, never user input).
    pub fn field(mut self, key: &'static str, value: impl Into<Json>) -> Self {
        self.0.push((key, value.into()));
        self
    }

    /// Adds `key` only when `value` is `Some`: upstream leaves `None`
    /// fields out of most bodies.
    pub fn some(self, key: &'static str, value: Option<impl Into<Json>>) -> Self {
        match value {
            Some(v) => self.field(key, v),
            None => self,
        }
    }

    /// Adds `key` as `null` when `value` is `None`.
    pub fn nullable(self, key: &'static str, value: Option<impl Into<Json>>) -> Self {
        let v = value.map_or(Json::Null, Into::into);
        self.field(key, v)
    }
}

impl From<bool> for Json {
    fn from(v: bool) -> Json {
        Json::Bool(v)
    }
}

impl From<u64> for Json {
    fn from(v: u64) -> Json {
        Json::Uint(v)
    }
}

impl From<&str> for Json {
    fn from(v: &str) -> Json {
        Json::Str(v.to_owned())
    }
}

impl From<String> for Json {
    fn from(v: String) -> Json {
        Json::Str(v)
    }
}

impl From<Object> for Json {
    fn from(v: Object) -> Json {
        Json::Object(v)
    }
}

impl<T: Into<Json>> From<Vec<T>> for Json {
    fn from(v: Vec<T>) -> Json {
        Json::Array(v.into_iter().map(Into::into).collect())
    }
}

impl fmt::Display for Json {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Json::Null => f.write_str("null"),
            Json::Bool(b) => write!(f, "{b}"),
            Json::Uint(n) => write!(f, "{n}"),
            // serde_json escapes a string exactly as upstream's serializer.
            Json::Str(s) => f.write_str(&serde_json::Value::from(s.as_str()).to_string()),
            Json::Array(items) => {
                f.write_str("[")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_str("]")
            }
            Json::Object(o) => write!(f, "{o}"),
        }
    }
}

impl fmt::Display for Object {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}:{v}", Json::Str((*k).to_owned()))?;
        }
        f.write_str("}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_escapes() {
        let o = Object::new()
            .field("z", 1u64)
            .some("skipped", None::<bool>)
            .nullable("n", None::<u64>)
            .field("a", "q\"\\\n\u{1}é")
            .field("l", vec![1u64, 2])
            .field("o", Object::new().field("b", true))
            .field("e", Vec::<u64>::new());
        let s = o.to_string();
        assert_eq!(
            s,
            r#"{"z":1,"n":null,"a":"q\"\\\n\u0001é","l":[1,2],"o":{"b":true},"e":[]}"#
        );
        // It is JSON, and means what was built.
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v["a"], "q\"\\\n\u{1}é");
    }
}
