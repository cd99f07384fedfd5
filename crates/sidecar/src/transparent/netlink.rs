//! Netlink framing for nfnetlink batches, by hand: message headers,
//! attributes (type-length-value, padded to four bytes, nestable) and the
//! kernel's acknowledgements.
//!
//! Byte order follows the kernel's: the netlink and attribute headers are in
//! host order; nfnetlink's `res_id` and every nf_tables integer attribute
//! are big-endian (the kernel reads them with `ntohl`). Only what the
//! redirect needs is here; the constants are those of `linux/netlink.h` and
//! `linux/netfilter/nfnetlink.h`.

/// `sizeof(struct nlmsghdr)`: length, type, flags, sequence, port id.
pub(super) const NLMSG_HDRLEN: usize = 16;
/// `sizeof(struct nfgenmsg)`: family, version, resource id.
const NFGENMSG_LEN: usize = 4;
/// `sizeof(struct nlattr)`: length and type.
const NLA_HDRLEN: usize = 4;

/// `NLMSG_ERROR`: an acknowledgement (error 0) or an error.
pub(super) const NLMSG_ERROR: u16 = 2;

/// `NLM_F_REQUEST`: the kernel handles only requests.
pub(super) const NLM_F_REQUEST: u16 = 0x1;
/// `NLM_F_ACK`: answer this message with an `NLMSG_ERROR`, 0 on success.
pub(super) const NLM_F_ACK: u16 = 0x4;
/// `NLM_F_CREATE`: create the object if it does not exist (without
/// `NLM_F_EXCL`, an existing one is not an error).
pub(super) const NLM_F_CREATE: u16 = 0x400;
/// `NLM_F_APPEND`: add the rule at the end of the chain.
pub(super) const NLM_F_APPEND: u16 = 0x800;

/// `NLA_F_NESTED`: the attribute's payload is itself attributes.
const NLA_F_NESTED: u16 = 0x8000;

/// `NFNL_MSG_BATCH_BEGIN` (`NLMSG_MIN_TYPE`).
pub(super) const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
/// `NFNL_MSG_BATCH_END` (`NLMSG_MIN_TYPE + 1`).
pub(super) const NFNL_MSG_BATCH_END: u16 = 0x11;
/// `NFNL_SUBSYS_NFTABLES`: the subsystem a batch is for, and the high byte
/// of every nf_tables message type.
pub(super) const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// `AF_UNSPEC`: the family of the batch delimiters.
pub(super) const AF_UNSPEC: u8 = 0;
/// `NFNETLINK_V0`.
const NFNETLINK_V0: u8 = 0;

/// Rounds up to the four-byte alignment of messages and attributes
/// (`NLMSG_ALIGN`, `NLA_ALIGN`).
pub(super) const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// The header fields of one message, before its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    /// `nlmsg_type`.
    pub kind: u16,
    /// `nlmsg_flags`.
    pub flags: u16,
    /// `nlmsg_seq`, which the acknowledgement echoes.
    pub seq: u32,
    /// `nfgen_family` (`NFPROTO_*`).
    pub family: u8,
    /// `res_id`, sent big-endian.
    pub res_id: u16,
}

/// A buffer of consecutive netlink messages (one datagram, one batch).
///
/// Lengths are patched in when a message or nested attribute is closed. A
/// length that does not fit its field (`u16` for attributes, `u32` for
/// messages) is remembered and refused by [`Messages::finish`], never
/// written truncated.
#[derive(Debug, Default)]
pub(super) struct Messages {
    buf: Vec<u8>,
    oversized: bool,
}

impl Messages {
    /// Appends one message: header, `nfgenmsg`, then whatever `attrs` writes.
    pub fn message(&mut self, header: Header, attrs: impl FnOnce(&mut Attrs<'_>)) {
        let start = self.buf.len();
        // nlmsg_len (0..4) is patched below; nlmsg_pid (12..16) stays 0:
        // to the kernel.
        let mut head = [0u8; NLMSG_HDRLEN + NFGENMSG_LEN];
        head[4..6].copy_from_slice(&header.kind.to_ne_bytes());
        head[6..8].copy_from_slice(&header.flags.to_ne_bytes());
        head[8..12].copy_from_slice(&header.seq.to_ne_bytes());
        head[16] = header.family;
        head[17] = NFNETLINK_V0;
        head[18..20].copy_from_slice(&header.res_id.to_be_bytes());
        self.buf.extend_from_slice(&head);
        let mut writer = Attrs {
            buf: &mut self.buf,
            oversized: false,
        };
        attrs(&mut writer);
        let oversized = writer.oversized;
        match u32::try_from(self.buf.len() - start) {
            Ok(len) if !oversized => self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes()),
            _ => self.oversized = true,
        }
    }

    /// The encoded messages, or `None` when a length did not fit.
    pub fn finish(self) -> Option<Vec<u8>> {
        (!self.oversized).then_some(self.buf)
    }
}

/// Writes the attributes of one message (or of one nested attribute).
pub(super) struct Attrs<'a> {
    buf: &'a mut Vec<u8>,
    oversized: bool,
}

impl Attrs<'_> {
    /// An attribute with `data` as its payload, zero-padded to four bytes
    /// (the padding is not counted in `nla_len`).
    pub fn bytes(&mut self, kind: u16, data: &[u8]) {
        let Ok(len) = u16::try_from(NLA_HDRLEN + data.len()) else {
            self.oversized = true;
            return;
        };
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.pad();
    }

    /// A `NLA_STRING`/`NLA_NUL_STRING`: the text and its terminating NUL.
    pub fn string(&mut self, kind: u16, text: &str) {
        let mut data = Vec::with_capacity(text.len() + 1);
        data.extend_from_slice(text.as_bytes());
        data.push(0);
        self.bytes(kind, &data);
    }

    /// A 32-bit integer, big-endian as nf_tables reads them.
    pub fn u32_be(&mut self, kind: u16, value: u32) {
        self.bytes(kind, &value.to_be_bytes());
    }

    /// A nested attribute (`NLA_F_NESTED`) whose payload `inner` writes;
    /// its length covers the inner attributes and their padding.
    pub fn nested(&mut self, kind: u16, inner: impl FnOnce(&mut Attrs<'_>)) {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0; 2]); // nla_len, patched below
        self.buf
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        let mut writer = Attrs {
            buf: &mut *self.buf,
            oversized: false,
        };
        inner(&mut writer);
        let inner_oversized = writer.oversized;
        match u16::try_from(self.buf.len() - start) {
            Ok(len) if !inner_oversized => {
                self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes())
            }
            _ => self.oversized = true,
        }
    }

    fn pad(&mut self) {
        let padded = align4(self.buf.len());
        self.buf.resize(padded, 0);
    }
}

/// One `NLMSG_ERROR` answer: the sequence number of the message it answers
/// and the error, 0 for an acknowledgement, else a positive errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ack {
    /// `nlmsg_seq` of the answered message.
    pub seq: u32,
    /// 0, or the errno the kernel refused the message with.
    pub errno: i32,
}

/// Why an answer from the kernel could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MalformedAnswer {
    /// A message header claims fewer bytes than a header, or more than
    /// were received.
    #[error("a message length of {len} bytes does not fit the {left} bytes received")]
    Length {
        /// The `nlmsg_len` read.
        len: usize,
        /// Bytes left in the datagram at that point.
        left: usize,
    },
    /// An `NLMSG_ERROR` too short to hold its error code.
    #[error("an NLMSG_ERROR message without its error code")]
    ShortError,
}

/// The acknowledgements and errors in one datagram from the kernel. Other
/// message types (none is expected without `NLM_F_ECHO`) are skipped.
pub(super) fn parse_acks(mut datagram: &[u8]) -> Result<Vec<Ack>, MalformedAnswer> {
    let mut acks = Vec::new();
    while datagram.len() >= NLMSG_HDRLEN {
        let len = read_u32(datagram, 0) as usize;
        if len < NLMSG_HDRLEN || len > datagram.len() {
            return Err(MalformedAnswer::Length {
                len,
                left: datagram.len(),
            });
        }
        let kind = u16::from_ne_bytes([datagram[4], datagram[5]]);
        let seq = read_u32(datagram, 8);
        if kind == NLMSG_ERROR {
            // struct nlmsgerr: int error, then the request's header.
            if len < NLMSG_HDRLEN + 4 {
                return Err(MalformedAnswer::ShortError);
            }
            let error =
                i32::from_ne_bytes([datagram[16], datagram[17], datagram[18], datagram[19]]);
            acks.push(Ack {
                seq,
                errno: error.saturating_neg(),
            });
        }
        datagram = &datagram[align4(len).min(datagram.len())..];
    }
    Ok(acks)
}

/// A host-order `u32` at `at`; the caller has checked the length.
fn read_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_message(attrs: impl FnOnce(&mut Attrs<'_>)) -> Vec<u8> {
        let mut m = Messages::default();
        m.message(
            Header {
                kind: 0x0a00,
                flags: NLM_F_REQUEST | NLM_F_ACK,
                seq: 7,
                family: 2,
                res_id: 0,
            },
            attrs,
        );
        m.finish().unwrap()
    }

    #[test]
    fn header_fields_in_host_order_and_res_id_big_endian() {
        let mut m = Messages::default();
        m.message(
            Header {
                kind: NFNL_MSG_BATCH_BEGIN,
                flags: NLM_F_REQUEST,
                seq: 0x0102_0304,
                family: AF_UNSPEC,
                res_id: NFNL_SUBSYS_NFTABLES,
            },
            |_| {},
        );
        let bytes = m.finish().unwrap();
        let mut expected = Vec::new();
        expected.extend_from_slice(&20u32.to_ne_bytes());
        expected.extend_from_slice(&0x10u16.to_ne_bytes());
        expected.extend_from_slice(&1u16.to_ne_bytes());
        expected.extend_from_slice(&0x0102_0304u32.to_ne_bytes());
        expected.extend_from_slice(&0u32.to_ne_bytes());
        expected.extend_from_slice(&[0, 0, 0x00, 0x0a]);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn strings_carry_their_nul_and_are_padded_outside_the_length() {
        let bytes = one_message(|a| a.string(3, "output"));
        let attr = &bytes[NLMSG_HDRLEN + NFGENMSG_LEN..];
        // 4 header + 6 text + 1 NUL = 11, padded to 12.
        assert_eq!(attr.len(), 12);
        assert_eq!(u16::from_ne_bytes([attr[0], attr[1]]), 11);
        assert_eq!(u16::from_ne_bytes([attr[2], attr[3]]), 3);
        assert_eq!(&attr[4..], b"output\0\0");
        assert_eq!(read_u32(&bytes, 0) as usize, bytes.len());
    }

    #[test]
    fn integers_are_big_endian() {
        let bytes = one_message(|a| a.u32_be(2, (-100i32) as u32));
        let attr = &bytes[NLMSG_HDRLEN + NFGENMSG_LEN..];
        assert_eq!(u16::from_ne_bytes([attr[0], attr[1]]), 8);
        assert_eq!(&attr[4..], [0xff, 0xff, 0xff, 0x9c]);
    }

    #[test]
    fn nested_lengths_include_inner_padding_and_set_the_nested_flag() {
        let bytes = one_message(|a| {
            a.nested(3, |data| data.bytes(1, &[6]));
            a.u32_be(9, 1);
        });
        let attrs = &bytes[NLMSG_HDRLEN + NFGENMSG_LEN..];
        // Outer: 4 header + inner (4 header + 1 byte = 5, padded to 8) = 12.
        assert_eq!(u16::from_ne_bytes([attrs[0], attrs[1]]), 12);
        assert_eq!(u16::from_ne_bytes([attrs[2], attrs[3]]), 3 | 0x8000);
        assert_eq!(u16::from_ne_bytes([attrs[4], attrs[5]]), 5);
        assert_eq!(u16::from_ne_bytes([attrs[6], attrs[7]]), 1);
        assert_eq!(&attrs[8..12], [6, 0, 0, 0]);
        // The next attribute starts right after the padded nest.
        assert_eq!(u16::from_ne_bytes([attrs[12], attrs[13]]), 8);
        assert_eq!(u16::from_ne_bytes([attrs[14], attrs[15]]), 9);
        assert_eq!(attrs.len(), 20);
    }

    #[test]
    fn an_attribute_too_long_for_its_length_field_is_refused_not_truncated() {
        let mut m = Messages::default();
        m.message(
            Header {
                kind: 0x0a00,
                flags: NLM_F_REQUEST,
                seq: 1,
                family: 2,
                res_id: 0,
            },
            |a| a.nested(1, |inner| inner.bytes(1, &vec![0; 70_000])),
        );
        assert!(m.finish().is_none());
    }

    fn error_message(seq: u32, error: i32) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&36u32.to_ne_bytes());
        out.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        out.extend_from_slice(&0u16.to_ne_bytes());
        out.extend_from_slice(&seq.to_ne_bytes());
        out.extend_from_slice(&1234u32.to_ne_bytes());
        out.extend_from_slice(&error.to_ne_bytes());
        out.extend_from_slice(&[0; 16]); // the request's header
        out
    }

    #[test]
    fn acks_and_errors_are_read_with_their_sequence_numbers() {
        let mut datagram = error_message(1, 0);
        datagram.extend(error_message(2, -1));
        assert_eq!(
            parse_acks(&datagram).unwrap(),
            [Ack { seq: 1, errno: 0 }, Ack { seq: 2, errno: 1 }]
        );
        assert_eq!(parse_acks(&[]).unwrap(), []);
    }

    #[test]
    fn malformed_answers_are_refused() {
        let mut short = error_message(1, 0);
        short[0..4].copy_from_slice(&200u32.to_ne_bytes());
        assert_eq!(
            parse_acks(&short),
            Err(MalformedAnswer::Length { len: 200, left: 36 })
        );
        let mut no_code = error_message(1, 0);
        no_code.truncate(16);
        no_code[0..4].copy_from_slice(&16u32.to_ne_bytes());
        assert_eq!(parse_acks(&no_code), Err(MalformedAnswer::ShortError));
        let mut zero = error_message(1, 0);
        zero[0..4].copy_from_slice(&0u32.to_ne_bytes());
        assert!(parse_acks(&zero).is_err(), "a zero length must not loop");
    }
}
