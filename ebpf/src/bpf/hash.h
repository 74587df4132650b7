// SPDX-License-Identifier: Apache-2.0 OR GPL-2.0
// The bucket hash of the prefix-hash maps, in host byte order. The loader has a Rust
// copy (dataplane/src/fastpath/keys.rs); a test there compiles this file for the host
// and compares the two on sample inputs. BUCKETS, BUCKET_HASH4 and BUCKET_HASH6 come
// from build.rs (ebpf/src/constants.rs).
#ifndef WIRESPAN_HASH_H
#define WIRESPAN_HASH_H

#if !defined(BUCKETS) || !defined(BUCKET_HASH4) || !defined(BUCKET_HASH6)
#error "BUCKETS, BUCKET_HASH4 and BUCKET_HASH6 are passed by build.rs (ebpf/src/constants.rs)"
#endif

// Bucket of an IPv4 address (host order), from its top 24 bits.
static inline __u32 wirespan_bucket4(__u32 addr)
{
	return (((addr >> 8) * BUCKET_HASH4) >> 16) & (BUCKETS - 1);
}

// Bucket of an IPv6 address, from its top 64 bits (host order).
static inline __u32 wirespan_bucket6(__u64 hi)
{
	return (__u32)((hi * BUCKET_HASH6) >> 48) & (BUCKETS - 1);
}

#endif
