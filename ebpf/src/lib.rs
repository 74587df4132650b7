//! wirespan-ebpf: BPF programs of the marking fast path.
//!
//! The programs are C, compiled with clang by `build.rs` and embedded as object bytes
//! for the loader in `wirespan-dataplane`. The tc classifier lands with the fast-path
//! work; until then this crate only fixes the workspace layout.
