//! What an interface's driver does with XDP, from the kernel's `netdev` generic netlink
//! family (Linux 6.3 on): whether it transmits frames in several buffers that a program on
//! another interface redirects to it (`NETDEV_XDP_ACT_NDO_XMIT_SG`). The kernel drops such
//! a frame, uncounted, after the program returned XDP_REDIRECT towards a driver without it
//! (and towards any interface of a device map before 6.3), so the program hands those
//! frames to the stack instead unless their egress is in `EGRESS_FRAGS`.

use anyhow::{bail, Context, Result};
use netlink_packet_core::{
    DecodeError, Emitable, NetlinkBuffer, NetlinkMessage, NetlinkPayload, NlasIterator,
    ParseableParametrized, NLM_F_REQUEST,
};
use netlink_packet_generic::{
    ctrl::{nlas::GenlCtrlAttrs, GenlCtrl, GenlCtrlCmd},
    GenlFamily, GenlHeader, GenlMessage,
};
use netlink_sys::{protocols::NETLINK_GENERIC, Socket, SocketAddr};

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
        let mut socket =
            Socket::new(NETLINK_GENERIC).context("opening a generic netlink socket")?;
        // The kernel answers while it takes the request; the bound keeps a lost answer from
        // holding the agent, which asks with its controller's lock held.
        socket2::SockRef::from(&socket).set_read_timeout(Some(ANSWER_WITHIN))?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        let mut ctrl = GenlMessage::from_payload(GenlCtrl {
            cmd: GenlCtrlCmd::GetFamily,
            nlas: vec![GenlCtrlAttrs::FamilyName(DevGet::family_name().into())],
        });
        ctrl.finalize();
        let family = match ask(&socket, 1, ctrl)? {
            Answer::Payload(GenlCtrl { nlas, .. }) => nlas.into_iter().find_map(|a| match a {
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
        self.sequence += 1;
        match ask(&self.socket, self.sequence, request)? {
            Answer::Payload(dev) => Ok(dev
                .xdp_features
                .is_some_and(|f| f & NETDEV_XDP_ACT_NDO_XMIT_SG != 0)),
            Answer::Errno(e) => bail!(
                "asking for the XDP features of interface {ifindex}: {}",
                std::io::Error::from_raw_os_error(e)
            ),
        }
    }
}

enum Answer<F> {
    Payload(F),
    /// The kernel's error, a positive errno.
    Errno(i32),
}

/// Sends `request` as number `sequence` and reads its one answer, past any other (a late
/// answer to an earlier request that timed out).
fn ask<F>(socket: &Socket, sequence: u32, request: GenlMessage<F>) -> Result<Answer<F>>
where
    F: GenlFamily + Emitable + ParseableParametrized<[u8], GenlHeader> + std::fmt::Debug,
{
    let mut message = NetlinkMessage::from(request);
    message.header.flags = NLM_F_REQUEST;
    message.header.sequence_number = sequence;
    message.finalize();
    let mut out = vec![0; message.buffer_len()];
    message.serialize(&mut out);
    socket.send(&out, 0).context("sending a netlink request")?;
    // Answers of this family are far smaller.
    let mut answer = Vec::with_capacity(1 << 15);
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

/// The answer in `answer`, one message of this family.
fn read<F>(answer: &[u8]) -> Result<Answer<F>>
where
    F: GenlFamily + Emitable + ParseableParametrized<[u8], GenlHeader> + std::fmt::Debug,
{
    let answer = NetlinkMessage::<GenlMessage<F>>::deserialize(answer)
        .context("reading a netlink answer")?;
    match answer.payload {
        NetlinkPayload::InnerMessage(m) => Ok(Answer::Payload(m.payload)),
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
