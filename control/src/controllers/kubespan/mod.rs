//! KubeSpan controllers (spec `kubespan-dataplane.md`).
