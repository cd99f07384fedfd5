//! The Cedar schema every policy set is validated against, built into the
//! binary so that `lanyard policy check` and the agent agree exactly.

use std::sync::LazyLock;

use cedar_policy::{Entity, Schema};

/// The schema's text (`policies/schema.cedarschema`).
pub const SCHEMA: &str = include_str!("../../policies/schema.cedarschema");

struct Parsed {
    schema: Schema,
    actions: Vec<Entity>,
}

static PARSED: LazyLock<Parsed> = LazyLock::new(|| {
    // The schema is part of the binary and a test parses it: a failure here
    // is a build defect, not an input error.
    let (schema, _) = Schema::from_cedarschema_str(SCHEMA).expect("the built-in schema parses");
    let actions = schema
        .action_entities()
        .expect("the built-in schema's actions form entities")
        .iter()
        .cloned()
        .collect();
    Parsed { schema, actions }
});

/// The parsed schema.
pub fn schema() -> &'static Schema {
    &PARSED.schema
}

/// The schema's action entities (with their group), which every request's
/// entities include so `action in Action::"credential"` holds.
pub fn actions() -> &'static [Entity] {
    &PARSED.actions
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_schema_parses_without_warnings() {
        let (_, warnings) = cedar_policy::Schema::from_cedarschema_str(super::SCHEMA).unwrap();
        assert_eq!(warnings.count(), 0);
        assert!(super::actions().len() >= 4);
    }
}
