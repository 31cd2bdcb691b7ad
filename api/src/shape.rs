//! The shape of a JSON object that one process writes and another reads outside gRPC
//! (a checkpoint's `MANIFEST.json`, the local cluster's `cluster.json`): its field names
//! and their types, in one place, for the generated Python contract (`TypedDict`s) and
//! for the writers' tests, which check their serde output against it.

/// The JSON type of a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldType {
    /// An integer.
    Int,
    /// An integer or `null`.
    OptionalInt,
    /// A string.
    Str,
    /// `true` or `false`.
    Bool,
    /// Any JSON object.
    Object,
    /// A list of objects of one shape.
    List(&'static Shape),
}

/// One field of a [`Shape`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// The JSON key.
    pub name: &'static str,
    /// Its type.
    pub ty: FieldType,
    /// Whether every writer writes it (a reader must accept its absence otherwise).
    pub required: bool,
    /// One line of documentation.
    pub doc: &'static str,
}

impl Field {
    /// A field every writer writes.
    pub const fn required(name: &'static str, ty: FieldType, doc: &'static str) -> Self {
        Self {
            name,
            ty,
            required: true,
            doc,
        }
    }

    /// A field a writer may leave out.
    pub const fn optional(name: &'static str, ty: FieldType, doc: &'static str) -> Self {
        Self {
            name,
            ty,
            required: false,
            doc,
        }
    }
}

/// A JSON object's fields, in the order its writer writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Its name in the generated Python (`TypedDict`).
    pub name: &'static str,
    /// One line of documentation (reStructuredText).
    pub doc: &'static str,
    /// Its fields.
    pub fields: &'static [Field],
}

impl Shape {
    /// The field names, in order.
    pub fn field_names(&self) -> Vec<&'static str> {
        self.fields.iter().map(|f| f.name).collect()
    }

    /// The names of the fields every writer writes, in order.
    pub fn required_names(&self) -> Vec<&'static str> {
        self.fields
            .iter()
            .filter(|f| f.required)
            .map(|f| f.name)
            .collect()
    }
}
