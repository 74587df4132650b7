// SPDX-License-Identifier: Apache-2.0 OR GPL-2.0
//
// wirespan marking fast path: tc ingress classifiers that mark mesh-bound packets
// exactly as the nftables prerouting chain does (spec kubespan-dataplane.md §6.6):
//
//   (mark & mask) == device_mark           -> leave alone (WireGuard's own UDP)
//   destination in the routed set          -> mark = (mark & ~mask) | route_mark
//   anything else, or anything unparsable  -> leave alone
//
// Every program returns TC_ACT_UNSPEC (= TCX_NEXT): it never decides a packet's fate,
// the next classifier (or the stack) does.
//
// Two lookup structures, chosen by the loader:
//
// * "phash" (default): one hash map per family keyed by (masked address, mask), and a
//   bitmap of the prefix lengths present. Lengths >= 24 (IPv4) / >= 64 (IPv6) are
//   recorded per bucket (65,536 buckets chosen by a multiplicative hash of the top
//   24 / 64 address bits), shorter ones globally. A lookup probes only the lengths
//   present for its bucket, longest first: a host hit, a CIDR hit in a bucket without
//   hosts, and a miss in a bucket holding only hosts each cost one hash lookup; a miss
//   in an empty bucket costs none. Membership is all that matters (every entry carries
//   the same route mark), so prefixes may overlap freely.
// * "lpm": exact-host hash map, then an LPM trie (the memory-tight fallback: no
//   bucket arrays).
//
// Bit j of a length bitmap stands for prefix length (32 - j) resp. (128 - j), so the
// lowest set bit is the longest length and `-(bit)` is the mask itself: no count of
// leading zeros is needed (the BPF backend has none).

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#if !defined(BUCKETS) || !defined(DEFAULT_ENTRIES)
#error "BUCKETS and DEFAULT_ENTRIES are passed by build.rs (ebpf/src/constants.rs)"
#endif
#if !defined(CNT_HIT) || !defined(CNT_MISS) || !defined(CNT_SKIPPED) || !defined(CNT_UNPARSED) || !defined(CNT_MAX)
#error "the counter indices CNT_* are passed by build.rs (ebpf/src/constants.rs)"
#endif

#include "hash.h"

struct config {
	__u32 device_mark;
	__u32 mask;
	// Lengths below the bucket boundary (bit 32 - len), plus /0 as bit 32.
	__u64 v4_global;
	// IPv6 lengths 1..63: bit (128 - len) - 64 of this word.
	__u64 v6_global_hi;
	// Route mark for ::/0 (0 = absent).
	__u32 v6_all_mark;
	__u32 _pad;
};

struct key4 {
	__u32 addr; // network order, masked
	__u32 mask; // host order
};

struct key6 {
	__u64 hi;   // host order, masked
	__u64 lo;   // host order, masked
	__u64 id;   // mask_lo ^ ~mask_hi: unique per length
};

struct bits6 {
	__u64 lo; // lengths 65..128: bit 128 - len
	__u64 hi; // length 64: bit 0
};

struct lpm4 {
	__u32 prefixlen;
	__u32 addr;
};

struct lpm6 {
	__u32 prefixlen;
	__u8 addr[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
} wirespan_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} wirespan_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, DEFAULT_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct key4);
	__type(value, __u32);
} wirespan_phash_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, DEFAULT_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct key6);
	__type(value, __u32);
} wirespan_phash_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, BUCKETS);
	__type(key, __u32);
	__type(value, __u64);
} wirespan_buckets_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, BUCKETS);
	__type(key, __u32);
	__type(value, struct bits6);
} wirespan_buckets_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, DEFAULT_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u32);
} wirespan_hosts_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, DEFAULT_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct in6_addr);
	__type(value, __u32);
} wirespan_hosts_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, DEFAULT_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lpm4);
	__type(value, __u32);
} wirespan_lpm_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, DEFAULT_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lpm6);
	__type(value, __u32);
} wirespan_lpm_v6 SEC(".maps");

static __always_inline void count(__u32 which)
{
	__u64 *c = bpf_map_lookup_elem(&wirespan_counters, &which);
	if (c)
		*c += 1;
}

// The parsed destination: family 4 or 6, 0 when unparsable.
struct dst {
	int family;
	__u32 v4;          // network order
	struct in6_addr v6;
};

static __always_inline struct dst parse(struct __sk_buff *skb, int l2)
{
	struct dst d = { 0 };
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u16 proto;

	if (l2) {
		struct ethhdr *eth = data;
		if ((void *)(eth + 1) > end)
			return d;
		proto = eth->h_proto;
		data = eth + 1;
	} else {
		proto = skb->protocol;
	}
	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = data;
		if ((void *)(ip + 1) > end || ip->version != 4)
			return d;
		d.family = 4;
		d.v4 = ip->daddr;
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = data;
		if ((void *)(ip6 + 1) > end || ip6->version != 6)
			return d;
		d.family = 6;
		__builtin_memcpy(&d.v6, &ip6->daddr, sizeof(d.v6));
	}
	return d;
}

static __always_inline __u32 *phash_lookup4(struct config *cfg, __u32 addr)
{
	__u32 b = wirespan_bucket4(bpf_ntohl(addr));
	__u64 *bb = bpf_map_lookup_elem(&wirespan_buckets_v4, &b);
	__u64 bits = cfg->v4_global | (bb ? *bb : 0);
	struct key4 k;

	for (int i = 0; i < 33 && bits; i++) {
		__u64 iso = bits & -bits;
		bits ^= iso;
		__u32 mask = (__u32)(0 - iso);
		k.addr = addr & bpf_htonl(mask);
		k.mask = mask;
		__u32 *v = bpf_map_lookup_elem(&wirespan_phash_v4, &k);
		if (v)
			return v;
	}
	return 0;
}

static __always_inline __u32 phash_lookup6(struct config *cfg, struct in6_addr *a)
{
	__u64 hi, lo;
	__builtin_memcpy(&hi, &a->in6_u.u6_addr8[0], 8);
	__builtin_memcpy(&lo, &a->in6_u.u6_addr8[8], 8);
	hi = bpf_be64_to_cpu(hi);
	lo = bpf_be64_to_cpu(lo);

	__u32 b = wirespan_bucket6(hi);
	struct bits6 *bb = bpf_map_lookup_elem(&wirespan_buckets_v6, &b);
	__u64 wlo = bb ? bb->lo : 0;
	__u64 whi = cfg->v6_global_hi | (bb ? bb->hi : 0);
	struct key6 k;

	for (int i = 0; i < 128 && (wlo | whi); i++) {
		__u64 mhi, mlo;
		if (wlo) {
			__u64 iso = wlo & -wlo;
			wlo ^= iso;
			mhi = ~0ull;
			mlo = 0 - iso;
		} else {
			__u64 iso = whi & -whi;
			whi ^= iso;
			mhi = 0 - iso;
			mlo = 0;
		}
		k.hi = hi & mhi;
		k.lo = lo & mlo;
		k.id = mlo ^ ~mhi;
		__u32 *v = bpf_map_lookup_elem(&wirespan_phash_v6, &k);
		if (v)
			return *v;
	}
	return cfg->v6_all_mark;
}

static __always_inline __u32 lpm_lookup(struct dst *d)
{
	__u32 *v;
	if (d->family == 4) {
		v = bpf_map_lookup_elem(&wirespan_hosts_v4, &d->v4);
		if (v)
			return *v;
		struct lpm4 k = { .prefixlen = 32, .addr = d->v4 };
		v = bpf_map_lookup_elem(&wirespan_lpm_v4, &k);
	} else {
		v = bpf_map_lookup_elem(&wirespan_hosts_v6, &d->v6);
		if (v)
			return *v;
		struct lpm6 k = { .prefixlen = 128 };
		__builtin_memcpy(k.addr, &d->v6, 16);
		v = bpf_map_lookup_elem(&wirespan_lpm_v6, &k);
	}
	return v ? *v : 0;
}

// Lookup kinds.
#define LOOKUP_PHASH 0
#define LOOKUP_LPM 1
#define LOOKUP_FLOOR 2

static __always_inline int classify(struct __sk_buff *skb, int l2, int kind)
{
	__u32 zero = 0;
	struct config *cfg = bpf_map_lookup_elem(&wirespan_config, &zero);
	if (!cfg)
		return TC_ACT_UNSPEC;
	__u32 mark = skb->mark;
	if ((mark & cfg->mask) == cfg->device_mark) {
		count(CNT_SKIPPED);
		return TC_ACT_UNSPEC;
	}
	struct dst d = parse(skb, l2);
	if (!d.family) {
		count(CNT_UNPARSED);
		return TC_ACT_UNSPEC;
	}
	__u32 route = 0;
	if (kind == LOOKUP_PHASH) {
		if (d.family == 4) {
			__u32 *v = phash_lookup4(cfg, d.v4);
			route = v ? *v : 0;
		} else {
			route = phash_lookup6(cfg, &d.v6);
		}
	} else if (kind == LOOKUP_LPM) {
		route = lpm_lookup(&d);
	} else {
		// The floor of the benchmark: one exact-host hash lookup, nothing else.
		__u32 *v = d.family == 4 ? bpf_map_lookup_elem(&wirespan_hosts_v4, &d.v4)
					 : bpf_map_lookup_elem(&wirespan_hosts_v6, &d.v6);
		route = v ? *v : 0;
	}
	if (route) {
		skb->mark = (mark & ~cfg->mask) | route;
		count(CNT_HIT);
	} else {
		count(CNT_MISS);
	}
	return TC_ACT_UNSPEC;
}

SEC("classifier")
int wirespan_phash(struct __sk_buff *skb) { return classify(skb, 1, LOOKUP_PHASH); }

SEC("classifier")
int wirespan_phash_l3(struct __sk_buff *skb) { return classify(skb, 0, LOOKUP_PHASH); }

SEC("classifier")
int wirespan_lpm(struct __sk_buff *skb) { return classify(skb, 1, LOOKUP_LPM); }

SEC("classifier")
int wirespan_lpm_l3(struct __sk_buff *skb) { return classify(skb, 0, LOOKUP_LPM); }

// Benchmark reference points: one hash lookup, and nothing at all.
SEC("classifier")
int wirespan_floor(struct __sk_buff *skb) { return classify(skb, 1, LOOKUP_FLOOR); }

SEC("classifier")
int wirespan_empty(struct __sk_buff *skb) { return TC_ACT_UNSPEC; }

// Benchmark traffic source: with BPF_F_TEST_XDP_LIVE_FRAMES every frame is passed
// to the stack of the interface it is "received" on. Live-frame pages are recycled
// with whatever the stack wrote into them, and forwarding decrements the TTL in
// place: restore TTL 64 (and the header checksum) so a recycled frame is forwarded
// like a fresh one. (The benchmark gives the sink the ingress interface's MAC, so the
// rewritten destination MAC stays right.)
SEC("xdp")
int wirespan_xdp_pass(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->ttl == 64)
		return XDP_PASS;
	ip->ttl = 64;
	ip->check = 0;
	__u16 *w = (__u16 *)ip;
	__u32 sum = 0;
#pragma unroll
	for (int i = 0; i < 10; i++)
		sum += w[i];
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	ip->check = (__u16)~sum;
	return XDP_PASS;
}

// Benchmark sink: counts and drops.
SEC("xdp")
int wirespan_xdp_sink(struct xdp_md *ctx)
{
	count(CNT_HIT);
	return XDP_DROP;
}

char LICENSE[] SEC("license") = "GPL";
