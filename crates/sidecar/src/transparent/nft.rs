//! The redirect as one nf_tables batch: the messages `nft` sends for
//!
//! ```text
//! add table ip lanyard_transparent
//! delete table ip lanyard_transparent
//! add table ip lanyard_transparent
//! add chain ip lanyard_transparent output { type nat hook output priority -100; }
//! add rule ip lanyard_transparent output ip daddr 169.254.169.254 tcp dport 80 redirect to :PORT
//! ```
//!
//! encoded as `nft --debug=mnl` shows them (the constants are those of
//! `linux/netfilter/nf_tables.h`, `linux/netfilter.h` and
//! `linux/netfilter/nf_nat.h`). The kernel applies a batch as one
//! transaction: all of it or none of it.

use std::fmt;

use super::netlink::{
    Attrs, Header, Messages, AF_UNSPEC, NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END,
    NFNL_SUBSYS_NFTABLES, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST,
};
use super::{CHAIN, METADATA_ADDR, METADATA_PORT, TABLE};

// enum nf_tables_msg_types
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;

/// `NFPROTO_IPV4`: the `ip` family.
const NFPROTO_IPV4: u8 = 2;
/// `NF_INET_LOCAL_OUT`: the output hook, which sees the pod's own
/// connections as they leave its processes.
const NF_INET_LOCAL_OUT: u32 = 3;
/// `NF_IP_PRI_NAT_DST` (`dstnat`): where destination NAT runs.
const NAT_DST_PRIORITY: i32 = -100;

// enum nft_table_attributes
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
// enum nft_chain_attributes
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_TYPE: u16 = 7;
// enum nft_hook_attributes
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
// enum nft_rule_attributes
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
// enum nft_list_attributes
const NFTA_LIST_ELEM: u16 = 1;
// enum nft_expr_attributes
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
// enum nft_payload_attributes and enum nft_payload_bases
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
// enum nft_cmp_attributes and enum nft_cmp_ops
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFT_CMP_EQ: u32 = 0;
// enum nft_data_attributes
const NFTA_DATA_VALUE: u16 = 1;
// enum nft_meta_attributes and enum nft_meta_keys
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFT_META_L4PROTO: u32 = 16;
// enum nft_immediate_attributes
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
// enum nft_redir_attributes
const NFTA_REDIR_REG_PROTO_MIN: u16 = 1;
const NFTA_REDIR_REG_PROTO_MAX: u16 = 2;
const NFTA_REDIR_FLAGS: u16 = 3;
/// `NF_NAT_RANGE_PROTO_SPECIFIED`: the redirect names a port.
const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 1 << 1;

/// `NFT_REG_1`: the one register the rule uses.
const NFT_REG_1: u32 = 1;
/// Offset of the destination address in the IPv4 header.
const IPV4_DADDR_OFFSET: u32 = 16;
/// Offset of the destination port in the TCP header.
const TCP_DPORT_OFFSET: u32 = 2;
/// `IPPROTO_TCP`.
const IPPROTO_TCP: u8 = 6;

/// The nf_tables message type of `msg` (`NFNL_SUBSYS_NFTABLES << 8 | msg`).
const fn nft_type(msg: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | msg
}

/// One message of the batch, to name the one the kernel refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// `NFNL_MSG_BATCH_BEGIN`: the batch as a whole (permission, a missing
    /// nf_tables, a failed commit are reported against it).
    BatchBegin,
    /// `NFT_MSG_NEWTABLE`, creating the table or finding it there.
    AddTable,
    /// `NFT_MSG_DELTABLE`, dropping what an earlier run left.
    DeleteTable,
    /// `NFT_MSG_NEWTABLE` again, the table this run fills.
    CreateTable,
    /// `NFT_MSG_NEWCHAIN`: the nat chain on the output hook.
    AddChain,
    /// `NFT_MSG_NEWRULE`: the redirect itself.
    AddRule {
        /// The loopback port the rule redirects to.
        port: u16,
    },
    /// `NFNL_MSG_BATCH_END`: commit.
    BatchEnd,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::BatchBegin => write!(f, "the nf_tables batch (NFNL_MSG_BATCH_BEGIN)"),
            Step::AddTable | Step::CreateTable => {
                write!(f, "NFT_MSG_NEWTABLE (add table ip {TABLE})")
            }
            Step::DeleteTable => write!(f, "NFT_MSG_DELTABLE (delete table ip {TABLE})"),
            Step::AddChain => write!(
                f,
                "NFT_MSG_NEWCHAIN (add chain ip {TABLE} {CHAIN} {{ type nat hook output priority {NAT_DST_PRIORITY}; }})"
            ),
            Step::AddRule { port } => write!(
                f,
                "NFT_MSG_NEWRULE (add rule ip {TABLE} {CHAIN} ip daddr {METADATA_ADDR} tcp dport {METADATA_PORT} redirect to :{port})"
            ),
            Step::BatchEnd => write!(f, "the nf_tables batch commit (NFNL_MSG_BATCH_END)"),
        }
    }
}

/// The encoded batch and which step each sequence number carries.
#[derive(Debug)]
pub struct Batch {
    /// Every message, in order, as one datagram.
    pub bytes: Vec<u8>,
    /// Each message's sequence number and step, in order.
    pub steps: Vec<Numbered>,
}

/// One message of a [`Batch`], by sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Numbered {
    /// Its `nlmsg_seq`, which the kernel's answer echoes.
    pub seq: u32,
    /// What it does.
    pub step: Step,
    /// Whether it asks for an acknowledgement (`NLM_F_ACK`).
    pub acked: bool,
}

impl Batch {
    /// The step sent with sequence number `seq`.
    pub fn step(&self, seq: u32) -> Option<Step> {
        self.steps.iter().find(|n| n.seq == seq).map(|n| n.step)
    }

    /// The sequence numbers that ask for an acknowledgement, in order.
    pub fn acked(&self) -> Vec<u32> {
        self.steps
            .iter()
            .filter(|n| n.acked)
            .map(|n| n.seq)
            .collect()
    }
}

/// The batch that installs the redirect to `port`, numbered from
/// `first_seq`; `None` only if a length would overflow its field (never for
/// this fixed rule).
pub fn redirect_batch(port: u16, first_seq: u32) -> Option<Batch> {
    let mut messages = Messages::default();
    let mut steps = Vec::new();
    let mut seq = first_seq;
    let mut push = |step: Step, header: Header, attrs: &dyn Fn(&mut Attrs<'_>)| {
        messages.message(header, attrs);
        steps.push(Numbered {
            seq: header.seq,
            step,
            acked: header.flags & NLM_F_ACK != 0,
        });
    };
    let mut next = || {
        let s = seq;
        seq = seq.wrapping_add(1);
        s
    };
    // INVARIANT: the batch opens with BATCH_BEGIN for the nf_tables
    // subsystem and closes with BATCH_END; the kernel applies the messages
    // between them as one transaction only then (an unterminated batch is
    // aborted). Neither delimiter is acknowledged, so neither asks.
    push(
        Step::BatchBegin,
        delimiter(NFNL_MSG_BATCH_BEGIN, next()),
        &|_| {},
    );
    // INVARIANT: add, delete, add: the first add makes the delete succeed
    // whether or not an earlier run (a restarted init container) left the
    // table, and the delete takes that run's chain and rule with it, so the
    // result is always exactly one table, one chain, one rule.
    push(
        Step::AddTable,
        nft_header(NFT_MSG_NEWTABLE, NLM_F_CREATE, next()),
        &table_attrs_with_flags,
    );
    push(
        Step::DeleteTable,
        nft_header(NFT_MSG_DELTABLE, 0, next()),
        &table_attrs,
    );
    push(
        Step::CreateTable,
        nft_header(NFT_MSG_NEWTABLE, NLM_F_CREATE, next()),
        &table_attrs_with_flags,
    );
    // INVARIANT: table before chain before rule; each names its parent,
    // which must exist (in this transaction) when the kernel reads it.
    push(
        Step::AddChain,
        nft_header(NFT_MSG_NEWCHAIN, NLM_F_CREATE, next()),
        &chain_attrs,
    );
    push(
        Step::AddRule { port },
        nft_header(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, next()),
        &|a| rule_attrs(a, port),
    );
    push(
        Step::BatchEnd,
        delimiter(NFNL_MSG_BATCH_END, next()),
        &|_| {},
    );
    let bytes = messages.finish()?;
    Some(Batch { bytes, steps })
}

fn delimiter(kind: u16, seq: u32) -> Header {
    Header {
        kind,
        flags: NLM_F_REQUEST,
        seq,
        family: AF_UNSPEC,
        res_id: NFNL_SUBSYS_NFTABLES,
    }
}

fn nft_header(msg: u16, flags: u16, seq: u32) -> Header {
    Header {
        kind: nft_type(msg),
        flags: NLM_F_REQUEST | NLM_F_ACK | flags,
        seq,
        family: NFPROTO_IPV4,
        res_id: 0,
    }
}

fn table_attrs(a: &mut Attrs<'_>) {
    a.string(NFTA_TABLE_NAME, TABLE);
}

fn table_attrs_with_flags(a: &mut Attrs<'_>) {
    table_attrs(a);
    a.u32_be(NFTA_TABLE_FLAGS, 0);
}

fn chain_attrs(a: &mut Attrs<'_>) {
    a.string(NFTA_CHAIN_TABLE, TABLE);
    a.string(NFTA_CHAIN_NAME, CHAIN);
    a.string(NFTA_CHAIN_TYPE, "nat");
    a.nested(NFTA_CHAIN_HOOK, |hook| {
        hook.u32_be(NFTA_HOOK_HOOKNUM, NF_INET_LOCAL_OUT);
        // The kernel reads the priority as a big-endian two's-complement
        // 32-bit integer.
        hook.u32_be(
            NFTA_HOOK_PRIORITY,
            u32::from_be_bytes(NAT_DST_PRIORITY.to_be_bytes()),
        );
    });
}

/// `ip daddr 169.254.169.254 tcp dport 80 redirect to :PORT`, as nft
/// compiles it.
fn rule_attrs(a: &mut Attrs<'_>, port: u16) {
    a.string(NFTA_RULE_TABLE, TABLE);
    a.string(NFTA_RULE_CHAIN, CHAIN);
    a.nested(NFTA_RULE_EXPRESSIONS, |list| {
        payload(list, NFT_PAYLOAD_NETWORK_HEADER, IPV4_DADDR_OFFSET, 4);
        cmp_eq(list, &METADATA_ADDR.octets());
        expression(list, "meta", |e| {
            e.u32_be(NFTA_META_KEY, NFT_META_L4PROTO);
            e.u32_be(NFTA_META_DREG, NFT_REG_1);
        });
        cmp_eq(list, &[IPPROTO_TCP]);
        payload(list, NFT_PAYLOAD_TRANSPORT_HEADER, TCP_DPORT_OFFSET, 2);
        cmp_eq(list, &METADATA_PORT.to_be_bytes());
        expression(list, "immediate", |e| {
            e.u32_be(NFTA_IMMEDIATE_DREG, NFT_REG_1);
            e.nested(NFTA_IMMEDIATE_DATA, |d| {
                d.bytes(NFTA_DATA_VALUE, &port.to_be_bytes())
            });
        });
        expression(list, "redir", |e| {
            e.u32_be(NFTA_REDIR_REG_PROTO_MIN, NFT_REG_1);
            e.u32_be(NFTA_REDIR_REG_PROTO_MAX, NFT_REG_1);
            e.u32_be(NFTA_REDIR_FLAGS, NF_NAT_RANGE_PROTO_SPECIFIED);
        });
    });
}

/// One `NFTA_LIST_ELEM` of a rule: the expression's name and its data.
fn expression(list: &mut Attrs<'_>, name: &str, data: impl FnOnce(&mut Attrs<'_>)) {
    list.nested(NFTA_LIST_ELEM, |elem| {
        elem.string(NFTA_EXPR_NAME, name);
        elem.nested(NFTA_EXPR_DATA, data);
    });
}

/// Loads `len` bytes at `offset` of header `base` into register 1.
fn payload(list: &mut Attrs<'_>, base: u32, offset: u32, len: u32) {
    expression(list, "payload", |e| {
        e.u32_be(NFTA_PAYLOAD_DREG, NFT_REG_1);
        e.u32_be(NFTA_PAYLOAD_BASE, base);
        e.u32_be(NFTA_PAYLOAD_OFFSET, offset);
        e.u32_be(NFTA_PAYLOAD_LEN, len);
    });
}

/// Register 1 must equal `value` (in network order) for the rule to go on.
fn cmp_eq(list: &mut Attrs<'_>, value: &[u8]) {
    expression(list, "cmp", |e| {
        e.u32_be(NFTA_CMP_SREG, NFT_REG_1);
        e.u32_be(NFTA_CMP_OP, NFT_CMP_EQ);
        e.nested(NFTA_CMP_DATA, |d| d.bytes(NFTA_DATA_VALUE, value));
    });
}

#[cfg(test)]
mod tests {
    use super::super::netlink::{parse_acks, NLMSG_HDRLEN};
    use super::*;

    /// One message of an encoded batch, read back.
    struct Sent {
        kind: u16,
        flags: u16,
        seq: u32,
        nfgenmsg: [u8; 4],
        attrs: Vec<u8>,
    }

    fn split(bytes: &[u8]) -> Vec<Sent> {
        let mut out = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let len = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
            assert_eq!(len % 4, 0, "messages are 4-aligned");
            out.push(Sent {
                kind: u16::from_ne_bytes(rest[4..6].try_into().unwrap()),
                flags: u16::from_ne_bytes(rest[6..8].try_into().unwrap()),
                seq: u32::from_ne_bytes(rest[8..12].try_into().unwrap()),
                nfgenmsg: rest[16..20].try_into().unwrap(),
                attrs: rest[NLMSG_HDRLEN + 4..len].to_vec(),
            });
            rest = &rest[len..];
        }
        out
    }

    /// Attribute bytes as `nft --debug=mnl` printed them for the same
    /// statements (nftables 1.0.6), written out in host order.
    fn attr(len: u16, kind: u16, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&len.to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(data);
        out
    }

    const NESTED: u16 = 0x8000;

    #[test]
    fn the_batch_is_framed_numbered_and_acknowledged_as_the_kernel_expects() {
        let batch = redirect_batch(8642, 100).unwrap();
        let messages = split(&batch.bytes);
        let kinds: Vec<u16> = messages.iter().map(|m| m.kind).collect();
        assert_eq!(
            kinds,
            [0x10, 0x0a00, 0x0a02, 0x0a00, 0x0a03, 0x0a06, 0x11],
            "begin, NEWTABLE, DELTABLE, NEWTABLE, NEWCHAIN, NEWRULE, end"
        );
        let seqs: Vec<u32> = messages.iter().map(|m| m.seq).collect();
        assert_eq!(seqs, (100..107).collect::<Vec<_>>());
        // Delimiters: AF_UNSPEC, res_id NFNL_SUBSYS_NFTABLES big-endian.
        assert_eq!(messages[0].nfgenmsg, [0, 0, 0, 10]);
        assert_eq!(messages[6].nfgenmsg, [0, 0, 0, 10]);
        assert_eq!(messages[0].flags, NLM_F_REQUEST);
        // nf_tables messages: NFPROTO_IPV4, and each asks for its ack.
        for m in &messages[1..6] {
            assert_eq!(m.nfgenmsg, [2, 0, 0, 0]);
            assert_eq!(
                m.flags & (NLM_F_REQUEST | NLM_F_ACK),
                NLM_F_REQUEST | NLM_F_ACK
            );
        }
        assert_eq!(messages[1].flags & NLM_F_CREATE, NLM_F_CREATE);
        assert_eq!(
            messages[2].flags & NLM_F_CREATE,
            0,
            "delete does not create"
        );
        assert_eq!(messages[5].flags & NLM_F_APPEND, NLM_F_APPEND);
        assert_eq!(batch.acked(), [101, 102, 103, 104, 105]);
        assert_eq!(batch.step(105), Some(Step::AddRule { port: 8642 }));
        assert_eq!(batch.step(100), Some(Step::BatchBegin));
        assert_eq!(batch.step(99), None);
        // Nothing in it reads as an answer.
        assert_eq!(parse_acks(&batch.bytes).unwrap(), []);
    }

    #[test]
    fn table_and_chain_match_nft() {
        let batch = redirect_batch(8642, 0).unwrap();
        let messages = split(&batch.bytes);
        let name = attr(24, 1, b"lanyard_transparent\0");
        let mut table = name.clone();
        table.extend(attr(8, 2, &[0, 0, 0, 0]));
        assert_eq!(messages[1].attrs, table);
        assert_eq!(messages[2].attrs, name);
        assert_eq!(messages[3].attrs, table);
        let mut chain = name;
        chain.extend(attr(11, 3, b"output\0\0"));
        chain.extend(attr(8, 7, b"nat\0"));
        chain.extend(attr(20, 4 | NESTED, &[]));
        chain.extend(attr(8, 1, &[0, 0, 0, 3]));
        chain.extend(attr(8, 2, &[0xff, 0xff, 0xff, 0x9c]));
        assert_eq!(messages[4].attrs, chain);
    }

    #[test]
    fn the_rule_matches_nft_with_the_port_big_endian() {
        let batch = redirect_batch(8642, 0).unwrap();
        let rule = &split(&batch.bytes)[5].attrs;
        let u32_attr = |kind: u16, v: u32| attr(8, kind, &v.to_be_bytes());
        let mut want = attr(24, 1, b"lanyard_transparent\0");
        want.extend(attr(11, 2, b"output\0\0"));
        let mut exprs = Vec::new();
        let payload = |base: u32, offset: u32, len: u32| {
            let mut e = attr(52, 1 | NESTED, &[]);
            e.extend(attr(12, 1, b"payload\0"));
            e.extend(attr(36, 2 | NESTED, &[]));
            for (k, v) in [(1, 1), (2, base), (3, offset), (4, len)] {
                e.extend(u32_attr(k, v));
            }
            e
        };
        let cmp = |value: &[u8]| {
            let padded = value.len().div_ceil(4) * 4;
            // NFTA_CMP_DATA: its header, NFTA_DATA_VALUE's, the value padded.
            let data_len = 8 + padded as u16;
            let expr_data_len = 4 + 8 + 8 + data_len;
            let mut e = attr(4 + 8 + expr_data_len, 1 | NESTED, &[]);
            e.extend(attr(8, 1, b"cmp\0"));
            e.extend(attr(expr_data_len, 2 | NESTED, &[]));
            e.extend(u32_attr(1, 1));
            e.extend(u32_attr(2, 0));
            e.extend(attr(data_len, 3 | NESTED, &[]));
            let mut v = value.to_vec();
            v.resize(padded, 0);
            e.extend(attr(4 + value.len() as u16, 1, &v));
            e
        };
        // Every cmp element is 44 bytes with a 12-byte NFTA_CMP_DATA, as
        // nft printed them.
        for v in [&[1u8][..], &[1, 2], &[1, 2, 3, 4]] {
            let e = cmp(v);
            assert_eq!((e.len(), u16::from_ne_bytes([e[0], e[1]])), (44, 44));
        }
        exprs.extend(payload(1, 16, 4));
        exprs.extend(cmp(&[169, 254, 169, 254]));
        exprs.extend(attr(36, 1 | NESTED, &[]));
        exprs.extend(attr(9, 1, b"meta\0\0\0\0"));
        exprs.extend(attr(20, 2 | NESTED, &[]));
        exprs.extend(u32_attr(2, 16));
        exprs.extend(u32_attr(1, 1));
        exprs.extend(cmp(&[6]));
        exprs.extend(payload(2, 2, 2));
        exprs.extend(cmp(&[0x00, 0x50]));
        exprs.extend(attr(44, 1 | NESTED, &[]));
        exprs.extend(attr(14, 1, b"immediate\0\0\0"));
        exprs.extend(attr(24, 2 | NESTED, &[]));
        exprs.extend(u32_attr(1, 1));
        exprs.extend(attr(12, 2 | NESTED, &[]));
        exprs.extend(attr(6, 1, &[0x21, 0xc2, 0, 0]));
        // nft 1.0.6 sends PROTO_MIN and FLAGS; PROTO_MAX (the same
        // register) makes the one-port range explicit.
        exprs.extend(attr(44, 1 | NESTED, &[]));
        exprs.extend(attr(10, 1, b"redir\0\0\0"));
        exprs.extend(attr(28, 2 | NESTED, &[]));
        exprs.extend(u32_attr(1, 1));
        exprs.extend(u32_attr(2, 1));
        exprs.extend(u32_attr(3, 2));
        want.extend(attr(4 + exprs.len() as u16, 4 | NESTED, &[]));
        want.extend(exprs);
        assert_eq!(rule, &want);
    }

    #[test]
    fn the_port_is_the_only_thing_that_changes() {
        let a = redirect_batch(8642, 0).unwrap().bytes;
        let b = redirect_batch(1, 0).unwrap().bytes;
        assert_eq!(a.len(), b.len());
        let differing: Vec<usize> = (0..a.len()).filter(|&i| a[i] != b[i]).collect();
        assert_eq!(differing.len(), 2, "{differing:?}");
        assert_eq!(&b[differing[0]..=differing[1]], [0, 1]);
    }

    #[test]
    fn steps_name_what_the_kernel_refused() {
        assert_eq!(
            Step::AddRule { port: 8642 }.to_string(),
            "NFT_MSG_NEWRULE (add rule ip lanyard_transparent output ip daddr 169.254.169.254 tcp dport 80 redirect to :8642)"
        );
        assert!(Step::AddChain.to_string().contains("priority -100"));
    }
}
