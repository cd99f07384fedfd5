//! The webhook's JSON Patch (RFC 6902): operations whose values are
//! serialized when they are added.
//!
//! Why not `json_patch::Patch`: its operations hold `serde_json::Value`s,
//! so each injected object (the sidecar container, the token volumes, the
//! environment variables) was first turned into a tree of values, then the
//! trees were written out and dropped. That took about a third of an
//! admission's instructions. Here each object is serialized once, straight
//! from its Kubernetes type, and the patch is written out as the texts
//! end to end. It serializes to the same JSON Patch document.

use json_patch::jsonptr::PointerBuf;
use serde::Serialize;
use serde_json::value::RawValue;

/// The operations the webhook emits: it only ever adds to the pod, and
/// replaces the values of the `NO_PROXY` variables it extends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// `add`: sets a member, inserts into an array, or appends at `-`.
    Add,
    /// `replace`: sets a member that must exist.
    Replace,
}

/// One operation.
#[derive(Debug, Clone, Serialize)]
pub struct Operation {
    /// What to do.
    pub op: Op,
    /// Where, as a JSON Pointer (RFC 6901) into the pod.
    pub path: PointerBuf,
    /// The value, already JSON.
    pub value: Box<RawValue>,
}

impl Operation {
    /// `op` of `value`, serialized now, at the pointer made of `tokens`
    /// (escaped as RFC 6901 requires).
    pub fn new<T: Serialize + ?Sized>(
        op: Op,
        tokens: &[&str],
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self::raw(
            op,
            tokens,
            serde_json::value::to_raw_value(value)?,
        ))
    }

    /// `op` of a value that is JSON already, at the pointer made of `tokens`.
    pub fn raw(op: Op, tokens: &[&str], value: Box<RawValue>) -> Self {
        Operation {
            op,
            path: PointerBuf::from_tokens(tokens.iter().copied()),
            value,
        }
    }
}

/// A JSON Patch document: the operations in order.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(transparent)]
pub struct Patch(pub Vec<Operation>);

impl Patch {
    /// Whether it has no operation.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The document json-patch reads and applies, pointer escapes included.
    #[test]
    fn serializes_as_a_json_patch_document() {
        let patch = Patch(vec![
            Operation::new(
                Op::Add,
                &["spec", "a/b", "c~d", "-"],
                &json!({"k": [1, "x"]}),
            )
            .unwrap(),
            Operation::new(Op::Replace, &["spec", "env", "0", "value"], "v\"1").unwrap(),
        ]);
        let text = serde_json::to_string(&patch).unwrap();
        assert_eq!(
            text,
            r#"[{"op":"add","path":"/spec/a~1b/c~0d/-","value":{"k":[1,"x"]}},{"op":"replace","path":"/spec/env/0/value","value":"v\"1"}]"#
        );
        let parsed: json_patch::Patch = serde_json::from_str(&text).unwrap();
        let mut doc = json!({"spec": {"a/b": {"c~d": []}, "env": [{"value": "old"}]}});
        json_patch::patch(&mut doc, &parsed).unwrap();
        assert_eq!(
            doc,
            json!({"spec": {"a/b": {"c~d": [{"k": [1, "x"]}]}, "env": [{"value": "v\"1"}]}})
        );
        assert!(Patch::default().is_empty() && !patch.is_empty());
    }
}
