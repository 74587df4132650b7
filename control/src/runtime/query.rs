//! Label and id queries (`docs/runtime.md` §2.5).

use std::collections::BTreeMap;

use regex::Regex;

/// Operator of a label term.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelOp {
    /// The label is present.
    Exists,
    /// The label equals the single value.
    Equal,
    /// The label equals one of the values.
    In,
    /// String less-than the single value.
    Lt,
    /// String less-than-or-equal the single value.
    Lte,
    /// Numeric (with unit suffix) less-than.
    LtNumeric,
    /// Numeric (with unit suffix) less-than-or-equal.
    LteNumeric,
}

/// One label term.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelTerm {
    /// Label key.
    pub key: String,
    /// Operand(s).
    pub values: Vec<String>,
    /// Operator.
    pub op: LabelOp,
    /// Negates exists/equal/in; comparisons on a missing label stay false.
    pub invert: bool,
}

impl LabelTerm {
    /// `key` exists.
    pub fn exists(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            values: vec![],
            op: LabelOp::Exists,
            invert: false,
        }
    }

    /// `key == value`.
    pub fn equal(key: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            values: vec![value.into()],
            op: LabelOp::Equal,
            invert: false,
        }
    }

    /// `key ∈ values`.
    pub fn is_in(
        key: impl Into<String>,
        values: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self {
            key: key.into(),
            values: values.into_iter().map(Into::into).collect(),
            op: LabelOp::In,
            invert: false,
        }
    }

    /// A term with an explicit operator.
    pub fn compare(key: impl Into<String>, op: LabelOp, value: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            values: vec![value.into()],
            op,
            invert: false,
        }
    }

    /// The negated term.
    #[must_use]
    pub fn inverted(mut self) -> Self {
        self.invert = !self.invert;
        self
    }

    /// Evaluates the term against labels.
    #[must_use]
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value = labels.get(&self.key);
        let operand = self.values.first().map_or("", String::as_str);
        match self.op {
            LabelOp::Exists => value.is_some() != self.invert,
            LabelOp::Equal => value.is_some_and(|v| v == operand) != self.invert,
            LabelOp::In => value.is_some_and(|v| self.values.contains(v)) != self.invert,
            LabelOp::Lt | LabelOp::Lte | LabelOp::LtNumeric | LabelOp::LteNumeric => {
                // A missing label or an unparsable number is false even when inverted.
                let Some(v) = value else { return false };
                let ord = if matches!(self.op, LabelOp::Lt | LabelOp::Lte) {
                    v.as_str().cmp(operand)
                } else {
                    match (parse_quantity(v), parse_quantity(operand)) {
                        (Some(a), Some(b)) => a.cmp(&b),
                        _ => return false,
                    }
                };
                let r = match self.op {
                    LabelOp::Lt | LabelOp::LtNumeric => ord.is_lt(),
                    _ => ord.is_le(),
                };
                r != self.invert
            }
        }
    }
}

/// A leading integer with an optional unit suffix (k, M, G, T, P; Ki … Pi).
#[must_use]
pub fn parse_quantity(s: &str) -> Option<i128> {
    let split = s
        .char_indices()
        .find(|&(i, c)| !(c.is_ascii_digit() || (i == 0 && c == '-')))
        .map_or(s.len(), |(i, _)| i);
    let (num, unit) = s.split_at(split);
    let n: i128 = num.parse().ok()?;
    let mult: i128 = match unit {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// A query: AND of its terms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelQuery(pub Vec<LabelTerm>);

impl LabelQuery {
    /// True when every term matches.
    #[must_use]
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|t| t.matches(labels))
    }
}

/// Filters of List and WatchKind: label queries OR-ed together, and an id regex.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Several queries are OR-ed; none matches everything.
    pub label_queries: Vec<LabelQuery>,
    /// Regex on the id.
    pub id_regex: Option<Regex>,
}

impl Filter {
    /// Matches everything.
    #[must_use]
    pub fn all() -> Self {
        Self::default()
    }

    /// A filter of one label query.
    #[must_use]
    pub fn labels(terms: Vec<LabelTerm>) -> Self {
        Self {
            label_queries: vec![LabelQuery(terms)],
            id_regex: None,
        }
    }

    /// True when the filter selects nothing out.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.label_queries.is_empty() && self.id_regex.is_none()
    }

    /// Evaluates the filter.
    #[must_use]
    pub fn matches(&self, id: &str, labels: &BTreeMap<String, String>) -> bool {
        (self.label_queries.is_empty() || self.label_queries.iter().any(|q| q.matches(labels)))
            && self.id_regex.as_ref().is_none_or(|r| r.is_match(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect()
    }

    #[test]
    fn terms_and_inversion() {
        let l = labels(&[("a", "1"), ("size", "2Ki")]);
        assert!(LabelTerm::exists("a").matches(&l));
        assert!(!LabelTerm::exists("b").matches(&l));
        assert!(LabelTerm::exists("b").inverted().matches(&l));
        assert!(LabelTerm::equal("a", "1").matches(&l));
        assert!(LabelTerm::is_in("a", ["0", "1"]).matches(&l));
        assert!(LabelTerm::is_in("z", ["0"]).inverted().matches(&l));
        // Comparisons on a missing label are false even inverted.
        assert!(!LabelTerm::compare("z", LabelOp::Lt, "5").matches(&l));
        assert!(!LabelTerm::compare("z", LabelOp::Lt, "5")
            .inverted()
            .matches(&l));
        assert!(LabelTerm::compare("size", LabelOp::LtNumeric, "3k").matches(&l));
        assert!(!LabelTerm::compare("size", LabelOp::LtNumeric, "2k").matches(&l));
        assert!(LabelTerm::compare("size", LabelOp::LteNumeric, "2048").matches(&l));
        // Unparsable number: false even inverted.
        assert!(!LabelTerm::compare("size", LabelOp::LtNumeric, "x")
            .inverted()
            .matches(&l));
        assert!(LabelTerm::compare("a", LabelOp::Lte, "1").matches(&l));
    }

    #[test]
    fn queries_or_and_id_regex() {
        let l = labels(&[("a", "1")]);
        let f = Filter {
            label_queries: vec![
                LabelQuery(vec![LabelTerm::equal("a", "2")]),
                LabelQuery(vec![LabelTerm::equal("a", "1")]),
            ],
            id_regex: Some(Regex::new("^x").unwrap()),
        };
        assert!(f.matches("xy", &l));
        assert!(!f.matches("yx", &l));
        assert!(Filter::all().matches("anything", &BTreeMap::new()));
        assert_eq!(parse_quantity("3Mi"), Some(3 << 20));
        assert_eq!(parse_quantity("7q"), None);
    }
}
