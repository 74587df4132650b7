//! Controllers by family (each family has a `register` function).

pub mod kubespan;
