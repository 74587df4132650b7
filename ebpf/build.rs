//! Compiles the BPF C programs in `src/bpf/` with clang into `$OUT_DIR`, where
//! `src/lib.rs` embeds them.
//!
//! clang is looked up as `$CLANG` if set, else `clang` on `PATH`. Without it the build
//! stops with a message saying how to install it.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

// BUCKETS, DEFAULT_ENTRIES, the bucket hash multipliers and the counter indices, the
// one definition.
include!("src/constants.rs");

const SOURCES: &[&str] = &["marking"];

/// The shared constants as clang `-D` flags.
fn constant_flags() -> Vec<String> {
    vec![
        format!("-DBUCKETS={BUCKETS}"),
        format!("-DDEFAULT_ENTRIES={DEFAULT_ENTRIES}"),
        format!("-DBUCKET_HASH4={BUCKET_HASH4:#x}u"),
        format!("-DBUCKET_HASH6={BUCKET_HASH6:#x}ull"),
        format!("-DCNT_HIT={}", counter::HIT),
        format!("-DCNT_MISS={}", counter::MISS),
        format!("-DCNT_SKIPPED={}", counter::SKIPPED),
        format!("-DCNT_UNPARSED={}", counter::UNPARSED),
        format!("-DCNT_MAX={}", counter::COUNT),
    ]
}

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let clang = env::var_os("CLANG").unwrap_or_else(|| "clang".into());
    println!("cargo:rerun-if-env-changed=CLANG");
    println!("cargo:rerun-if-changed=src/bpf");
    println!("cargo:rerun-if-changed=src/constants.rs");

    let version = Command::new(&clang).arg("--version").output();
    if !matches!(&version, Ok(o) if o.status.success()) {
        panic!(
            "\n\nwirespan-ebpf: clang is needed to compile the BPF programs, and `{}` could not be run{}.\n\
             Install it (Debian/Ubuntu): apt-get install -y --no-install-recommends clang llvm libbpf-dev\n\
             or run scripts/setup.sh, or point CLANG at a clang binary.\n\n",
            Path::new(&clang).display(),
            match &version {
                Err(e) => format!(" ({e})"),
                Ok(o) => format!(" (exit status {})", o.status),
            }
        );
    }

    // The multiarch include dir holds asm/types.h on Debian.
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_else(|_| "x86_64".into());
    let multiarch = format!("/usr/include/{arch}-linux-gnu");

    for name in SOURCES {
        let src = Path::new("src/bpf").join(format!("{name}.bpf.c"));
        let obj = out.join(format!("{name}.bpf.o"));
        let status = Command::new(&clang)
            .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"])
            .arg(format!("-I{multiarch}"))
            .args(constant_flags())
            .arg("-c")
            .arg(&src)
            .arg("-o")
            .arg(&obj)
            .status()
            .unwrap_or_else(|e| panic!("wirespan-ebpf: running clang on {}: {e}", src.display()));
        assert!(
            status.success(),
            "wirespan-ebpf: clang failed on {} ({status}); is libbpf-dev installed \
             (bpf/bpf_helpers.h)? apt-get install -y --no-install-recommends libbpf-dev",
            src.display()
        );
    }
}
