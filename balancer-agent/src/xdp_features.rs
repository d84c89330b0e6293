//! What the kernel says of XDP on an interface. Whether its driver transmits frames in
//! several buffers that a program on another interface redirects to it
//! (`NETDEV_XDP_ACT_NDO_XMIT_SG`, from the `netdev` generic netlink family, Linux 6.3 on):
//! the kernel drops such a frame, uncounted, after the program returned XDP_REDIRECT
//! towards a driver without it (and towards any interface of a device map before 6.3), so
//! the program hands those frames to the stack instead unless their egress is in
//! `EGRESS_FRAGS`. And the mode a program runs in there (rtnetlink), for a pinned link an
//! earlier agent made.

use anyhow::{bail, Context, Result};
use netlink_packet_core::{
    DecodeError, Emitable, NetlinkBuffer, NetlinkDeserializable, NetlinkMessage, NetlinkPayload,
    NetlinkSerializable, NlasIterator, ParseableParametrized, NLM_F_REQUEST,
};
use netlink_packet_generic::{
    ctrl::{nlas::GenlCtrlAttrs, GenlCtrl, GenlCtrlCmd},
    GenlFamily, GenlHeader, GenlMessage,
};
use netlink_sys::{
    protocols::{NETLINK_GENERIC, NETLINK_ROUTE},
    Socket, SocketAddr,
};
use rtnetlink::packet_route::{
    link::{LinkAttribute, LinkMessage, LinkXdp, XdpAttached},
    RouteNetlinkMessage,
};

/// From `include/uapi/linux/netdev.h`.
const NETDEV_CMD_DEV_GET: u8 = 1;
const NETDEV_A_DEV_IFINDEX: u16 = 1;
const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;
const NETDEV_XDP_ACT_NDO_XMIT_SG: u64 = 1 << 6;
/// How long an answer may take.
const ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_millis(500);

/// A `dev-get` request for one interface, or its answer.
#[derive(Debug, Default)]
struct DevGet {
    ifindex: Option<u32>,
    xdp_features: Option<u64>,
}

impl GenlFamily for DevGet {
    fn family_name() -> &'static str {
        "netdev"
    }

    fn command(&self) -> u8 {
        NETDEV_CMD_DEV_GET
    }

    fn version(&self) -> u8 {
        1
    }
}

impl Emitable for DevGet {
    fn buffer_len(&self) -> usize {
        self.ifindex.map_or(0, |_| 8)
    }

    fn emit(&self, buffer: &mut [u8]) {
        if let Some(ifindex) = self.ifindex {
            // One attribute: length, type, the index; 8 bytes, already aligned.
            buffer[0..2].copy_from_slice(&8u16.to_ne_bytes());
            buffer[2..4].copy_from_slice(&NETDEV_A_DEV_IFINDEX.to_ne_bytes());
            buffer[4..8].copy_from_slice(&ifindex.to_ne_bytes());
        }
    }
}

impl ParseableParametrized<[u8], GenlHeader> for DevGet {
    fn parse_with_param(buf: &[u8], _: GenlHeader) -> Result<Self, DecodeError> {
        let mut dev = DevGet::default();
        for nla in NlasIterator::new(buf) {
            let nla = nla?;
            let value = nla.value();
            match nla.kind() {
                NETDEV_A_DEV_IFINDEX => {
                    dev.ifindex = value.try_into().ok().map(u32::from_ne_bytes);
                }
                NETDEV_A_DEV_XDP_FEATURES => {
                    dev.xdp_features = value.try_into().ok().map(u64::from_ne_bytes);
                }
                _ => {}
            }
        }
        Ok(dev)
    }
}

/// A generic netlink socket that asks the `netdev` family.
pub struct Netdev {
    socket: Socket,
    /// The family's id, `None` where the kernel has no such family (before 6.3).
    family: Option<u16>,
    /// The last request's sequence number.
    sequence: u32,
}

impl Netdev {
    pub fn open() -> Result<Self> {
        let socket = open(NETLINK_GENERIC)?;
        let mut ctrl = GenlMessage::from_payload(GenlCtrl {
            cmd: GenlCtrlCmd::GetFamily,
            nlas: vec![GenlCtrlAttrs::FamilyName(DevGet::family_name().into())],
        });
        ctrl.finalize();
        let family = match ask(&socket, 1, ctrl)? {
            Answer::Payload(m) => m.payload.nlas.into_iter().find_map(|a| match a {
                GenlCtrlAttrs::FamilyId(id) => Some(id),
                _ => None,
            }),
            Answer::Errno(libc::ENOENT) => None,
            Answer::Errno(e) => bail!(
                "asking for the netdev netlink family: {}",
                std::io::Error::from_raw_os_error(e)
            ),
        };
        Ok(Self {
            socket,
            family,
            sequence: 1,
        })
    }

    /// Whether the driver of interface `ifindex` transmits redirected frames in several
    /// buffers; false where the kernel cannot say (before 6.3).
    pub fn transmits_multi_buffer(&mut self, ifindex: u32) -> Result<bool> {
        let Some(family) = self.family else {
            return Ok(false);
        };
        let mut request = GenlMessage::from_payload(DevGet {
            ifindex: Some(ifindex),
            xdp_features: None,
        });
        request.set_resolved_family_id(family);
        request.finalize();
        // Kept for the agent's life by its relinks: one question a second per interface.
        self.sequence = self.sequence.wrapping_add(1);
        match ask(&self.socket, self.sequence, request)? {
            Answer::Payload(m) => Ok(m
                .payload
                .xdp_features
                .is_some_and(|f| f & NETDEV_XDP_ACT_NDO_XMIT_SG != 0)),
            Answer::Errno(e) => bail!(
                "asking for the XDP features of interface {ifindex}: {}",
                std::io::Error::from_raw_os_error(e)
            ),
        }
    }
}

/// Whether the XDP program on interface `ifindex` runs in generic mode; `None` where none
/// is attached.
pub fn attached_generic(ifindex: u32) -> Result<Option<bool>> {
    let socket = open(NETLINK_ROUTE)?;
    let mut link = LinkMessage::default();
    link.header.index = ifindex;
    match ask(&socket, 1, RouteNetlinkMessage::GetLink(link))? {
        Answer::Payload(RouteNetlinkMessage::NewLink(link)) => {
            let xdp = link.attributes.into_iter().find_map(|a| match a {
                LinkAttribute::Xdp(xdp) => Some(xdp),
                _ => None,
            });
            let xdp = xdp.unwrap_or_default();
            let attached = xdp.iter().find_map(|x| match x {
                LinkXdp::Attached(mode) => Some(mode),
                _ => None,
            });
            Ok(match attached {
                Some(XdpAttached::SocketBuffer) => Some(true),
                // Offloaded and one other: generic if the other is.
                Some(XdpAttached::Multiple) => {
                    Some(xdp.iter().any(|x| matches!(x, LinkXdp::SkbProgId(_))))
                }
                Some(XdpAttached::None) | None => None,
                Some(_) => Some(false),
            })
        }
        Answer::Payload(other) => bail!("an unexpected rtnetlink answer: {other:?}"),
        Answer::Errno(e) => bail!(
            "asking for interface {ifindex}: {}",
            std::io::Error::from_raw_os_error(e)
        ),
    }
}

/// A netlink socket of `protocol`, connected to the kernel.
fn open(protocol: isize) -> Result<Socket> {
    let mut socket = Socket::new(protocol).context("opening a netlink socket")?;
    // The kernel answers while it takes the request; the bound keeps a lost answer from
    // holding the agent, which asks with its controller's lock held.
    socket2::SockRef::from(&socket).set_read_timeout(Some(ANSWER_WITHIN))?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    Ok(socket)
}

enum Answer<M> {
    Payload(M),
    /// The kernel's error, a positive errno.
    Errno(i32),
}

/// Sends `request` as number `sequence` and reads its one answer, past any other (a late
/// answer to an earlier request that timed out).
fn ask<M>(socket: &Socket, sequence: u32, request: M) -> Result<Answer<M>>
where
    M: NetlinkSerializable + NetlinkDeserializable + std::fmt::Debug,
{
    let mut message =
        NetlinkMessage::new(Default::default(), NetlinkPayload::InnerMessage(request));
    message.header.flags = NLM_F_REQUEST;
    message.header.sequence_number = sequence;
    message.finalize();
    let mut out = vec![0; message.buffer_len()];
    message.serialize(&mut out);
    socket.send(&out, 0).context("sending a netlink request")?;
    // An answer here is a few KB at most (a link's, with its statistics).
    let mut answer = Vec::with_capacity(1 << 16);
    // Each earlier request left at most one answer.
    for _ in 0..=sequence {
        answer.clear();
        socket
            .recv(&mut answer, 0)
            .context("reading a netlink answer")?;
        let header = NetlinkBuffer::new_checked(&answer).context("reading a netlink answer")?;
        if header.sequence_number() == sequence {
            return read(&answer);
        }
    }
    bail!("no netlink answer to request {sequence}")
}

/// The answer in `answer`, one message.
fn read<M>(answer: &[u8]) -> Result<Answer<M>>
where
    M: NetlinkDeserializable + std::fmt::Debug,
{
    let answer = NetlinkMessage::<M>::deserialize(answer).context("reading a netlink answer")?;
    match answer.payload {
        NetlinkPayload::InnerMessage(m) => Ok(Answer::Payload(m)),
        NetlinkPayload::Error(e) => match e.code {
            Some(code) => Ok(Answer::Errno(-code.get())),
            None => bail!("a netlink acknowledgement where an answer was due"),
        },
        other => bail!("an unexpected netlink answer: {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asked of this machine's kernel: loopback has no XDP program, and its driver does not
    /// take redirected frames.
    #[test]
    fn the_kernel_answers_for_loopback() {
        let lo = crate::dataplane::interface_index("lo").unwrap();
        assert_eq!(attached_generic(lo).unwrap(), None);
        let mut netdev = Netdev::open().unwrap();
        assert!(!netdev.transmits_multi_buffer(lo).unwrap());
        // Asked again on the same socket: the answers are matched by sequence number.
        assert!(!netdev.transmits_multi_buffer(lo).unwrap());
        // No such interface (where the kernel has the family to ask: 6.3 on).
        assert!(netdev.family.is_none() || netdev.transmits_multi_buffer(u32::MAX).is_err());
    }

    #[test]
    fn a_request_names_the_interface_and_an_answer_gives_its_features() {
        let request = DevGet {
            ifindex: Some(7),
            xdp_features: None,
        };
        let mut buf = vec![0; request.buffer_len()];
        request.emit(&mut buf);
        let header = GenlHeader {
            cmd: NETDEV_CMD_DEV_GET,
            version: 1,
        };
        let parsed = DevGet::parse_with_param(&buf, header).unwrap();
        assert_eq!(parsed.ifindex, Some(7));
        // The answer: the index, then the features (a u64, 12 bytes with its header).
        let mut answer = buf.clone();
        answer.extend_from_slice(&12u16.to_ne_bytes());
        answer.extend_from_slice(&NETDEV_A_DEV_XDP_FEATURES.to_ne_bytes());
        answer.extend_from_slice(&(NETDEV_XDP_ACT_NDO_XMIT_SG | 1).to_ne_bytes());
        let parsed = DevGet::parse_with_param(&answer, header).unwrap();
        assert_eq!(
            (parsed.ifindex, parsed.xdp_features),
            (Some(7), Some(NETDEV_XDP_ACT_NDO_XMIT_SG | 1))
        );
    }
}
