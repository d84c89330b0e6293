//! The gateway's way to a server, as its kernel routes it: for direct server return, a
//! server must be on a link of the gateway that the program is attached to. The program hands
//! the client's packet, still addressed to the VIP, to the server's MAC, and drops it when
//! the FIB names a router instead (`drop_dsr_routed`: a router would send it back to the
//! VIP) or an interface it is not attached to (`drop_dsr_egress`). Scrapes and health checks
//! are routed like any traffic and reach such a server all the same, so the health check of
//! a DSR server asks the FIB first, as `ip route get fibmatch` does, and a server behind a
//! router or another interface fails it, the reason named, and stops taking connections
//! that would be lost. The FIB entry, not the route the stack would use: that one may hold
//! exceptions (a redirect, say) that `bpf_fib_lookup` does not see.

use std::{
    ffi::CStr,
    net::{IpAddr, SocketAddr},
};

use anyhow::{Context, Result};
use futures_util::TryStreamExt;
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteMessage, RouteType, RouteVia,
};
use rtnetlink::{Handle, RouteMessageBuilder};

const IPPROTO_TCP: u8 = 6;

/// Why packets to a server would not reach it directly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotDirect {
    #[error(
        "the gateway reaches {to} through the router {router}{dev}, not on a link of its own: \
         with direct server return the router would get packets addressed to the VIP"
    )]
    Routed {
        to: IpAddr,
        router: String,
        dev: String,
    },
    #[error(
        "the gateway reaches {to} through {dev}, which is not in agent.interfaces: the program \
         sends frames only out of interfaces it is attached to"
    )]
    Unattached { to: IpAddr, dev: String },
    #[error("{to} is an address of the gateway itself")]
    Local { to: IpAddr },
    #[error("no route to {to} ({kind})")]
    NoRoute { to: IpAddr, kind: String },
}

/// What a pool with direct server return needs of the gateway's route to a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// `dsr`: the server itself is the next hop, on a link the program is attached to.
    OnLink,
    /// `tunnel`: the outer header's route, from `source` (the pool's `tunnel_source`), leaves
    /// by a link the program is attached to; routers are fine.
    Tunnel { source: IpAddr },
}

/// Asks the kernel's FIB, over rtnetlink, in the agent's network namespace.
pub struct Routes {
    handle: Handle,
}

impl Routes {
    /// Opens the rtnetlink socket; its connection runs as a task of the current runtime.
    pub fn new() -> Result<Self> {
        let (connection, handle, _) =
            rtnetlink::new_connection().context("opening an rtnetlink socket")?;
        tokio::spawn(connection);
        Ok(Routes { handle })
    }

    /// Ok when the FIB's route to `server` for the packets the program sends it (TCP to its
    /// port; through a tunnel, the outer header's, from its source) leaves by the
    /// `attached` interfaces (on every path, if the route has several) and, for DSR, has the
    /// server itself as next hop; a [`NotDirect`] error when it does not, any other when the
    /// kernel could not be asked.
    pub async fn direct(&self, server: SocketAddr, attached: &[String], path: Path) -> Result<()> {
        let to = server.ip();
        let prefix = if to.is_ipv4() { 32 } else { 128 };
        let builder = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(to, prefix)
            .context("a route request")?;
        let mut request = match path {
            Path::OnLink => builder.ip_protocol(IPPROTO_TCP).dport(server.port()),
            // No protocol: the kernel answers such questions for TCP, UDP and ICMP only.
            Path::Tunnel { source } => builder
                .source_prefix(source, prefix)
                .context("a route request")?,
        }
        .build();
        request.header.flags = RouteFlags::FibMatch;
        let answer = match self.handle.route().get(request).execute().try_next().await {
            Ok(Some(answer)) => answer,
            Ok(None) => anyhow::bail!("the kernel gave no route for {to}"),
            // ENETUNREACH and the like: the kernel's way of saying there is no route.
            Err(rtnetlink::Error::NetlinkError(e)) => {
                return Err(NotDirect::NoRoute {
                    to,
                    kind: e.to_string(),
                }
                .into())
            }
            Err(e) => return Err(e).with_context(|| format!("asking the route to {to}")),
        };
        verdict(to, &answer, attached, path == Path::OnLink).map_err(Into::into)
    }
}

/// What the FIB's answer for `to` means for direct server return from the `attached`
/// interfaces, `on_link` (DSR) or through a tunnel.
fn verdict(
    to: IpAddr,
    answer: &RouteMessage,
    attached: &[String],
    on_link: bool,
) -> Result<(), NotDirect> {
    match answer.header.kind {
        RouteType::Unicast => {}
        RouteType::Local => return Err(NotDirect::Local { to }),
        kind => {
            return Err(NotDirect::NoRoute {
                to,
                kind: format!("{kind:?}").to_lowercase(),
            })
        }
    }
    // Every interface the route leaves by, and the first router it names.
    let mut oifs = Vec::new();
    let mut router = None;
    for attribute in &answer.attributes {
        match attribute {
            RouteAttribute::Oif(index) => oifs.push(*index),
            RouteAttribute::Gateway(gateway) => router = router.or(other_than(to, gateway)),
            // An IPv4 route through an IPv6 router.
            RouteAttribute::Via(RouteVia::Inet6(gateway)) => {
                router = router.or(Some(gateway.to_string()))
            }
            // A route of several paths: the program's lookup may take any of them.
            RouteAttribute::MultiPath(hops) => {
                for hop in hops {
                    oifs.push(hop.interface_index);
                    for a in &hop.attributes {
                        if let RouteAttribute::Gateway(gateway) = a {
                            router = router.or(other_than(to, gateway));
                        }
                    }
                }
            }
            _ => {}
        }
    }
    let devs: Vec<String> = oifs.into_iter().filter_map(interface_name).collect();
    if let (Some(router), true) = (router, on_link) {
        return Err(NotDirect::Routed {
            to,
            router,
            dev: devs
                .first()
                .map_or_else(String::new, |name| format!(" (dev {name})")),
        });
    }
    match devs.into_iter().find(|dev| !attached.contains(dev)) {
        Some(dev) => Err(NotDirect::Unattached { to, dev }),
        None => Ok(()),
    }
}

/// The gateway named by a route, unless it is `to` itself (a route may name its own
/// destination as its gateway: the next hop is still the server).
fn other_than(to: IpAddr, gateway: &RouteAddress) -> Option<String> {
    let gateway = match gateway {
        RouteAddress::Inet(a) => IpAddr::V4(*a),
        RouteAddress::Inet6(a) => IpAddr::V6(*a),
        other => return Some(format!("{other:?}")),
    };
    (gateway != to).then(|| gateway.to_string())
}

fn interface_name(index: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: the buffer holds IF_NAMESIZE bytes, as if_indextoname requires; on success it
    // holds a NUL-terminated name.
    let name = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if name.is_null() {
        return None;
    }
    // SAFETY: as above.
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use rtnetlink::packet_route::route::{RouteNextHop, RouteType};

    use super::*;

    fn through(gateway: RouteAddress) -> RouteNextHop {
        let mut hop = RouteNextHop::default();
        hop.attributes.push(RouteAttribute::Gateway(gateway));
        hop
    }

    fn answer(kind: RouteType, attributes: Vec<RouteAttribute>) -> RouteMessage {
        let mut m = RouteMessage::default();
        m.header.kind = kind;
        m.attributes = attributes;
        m
    }

    #[test]
    fn only_the_server_itself_as_next_hop_is_direct() {
        let v4: IpAddr = "10.4.0.14".parse().unwrap();
        let v6: IpAddr = "fd00:4::14".parse().unwrap();
        let gw4 = RouteAddress::Inet(Ipv4Addr::new(10, 4, 0, 13));
        let gw6 = RouteAddress::Inet6("fd00:4::13".parse::<Ipv6Addr>().unwrap());
        let lo = RouteAttribute::Oif(1);
        let routed = |router: &str| {
            Err(NotDirect::Routed {
                to: v4,
                router: router.into(),
                dev: " (dev lo)".into(),
            })
        };
        let cases: Vec<(&str, IpAddr, RouteMessage, Result<(), NotDirect>)> = vec![
            (
                "on a link",
                v4,
                answer(RouteType::Unicast, vec![lo.clone()]),
                Ok(()),
            ),
            (
                "its own address as gateway",
                v4,
                answer(
                    RouteType::Unicast,
                    vec![
                        RouteAttribute::Gateway(RouteAddress::Inet(Ipv4Addr::new(10, 4, 0, 14))),
                        lo.clone(),
                    ],
                ),
                Ok(()),
            ),
            (
                "through a router",
                v4,
                answer(
                    RouteType::Unicast,
                    vec![RouteAttribute::Gateway(gw4.clone()), lo.clone()],
                ),
                routed("10.4.0.13"),
            ),
            (
                "IPv4 through an IPv6 router",
                v4,
                answer(
                    RouteType::Unicast,
                    vec![
                        RouteAttribute::Via(RouteVia::Inet6("fe80::1".parse().unwrap())),
                        lo.clone(),
                    ],
                ),
                routed("fe80::1"),
            ),
            (
                "one of several paths through a router",
                v4,
                answer(
                    RouteType::Unicast,
                    vec![
                        RouteAttribute::MultiPath(vec![
                            RouteNextHop::default(),
                            through(gw4.clone()),
                        ]),
                        lo.clone(),
                    ],
                ),
                routed("10.4.0.13"),
            ),
            (
                "IPv6 through a router",
                v6,
                answer(RouteType::Unicast, vec![RouteAttribute::Gateway(gw6)]),
                Err(NotDirect::Routed {
                    to: v6,
                    router: "fd00:4::13".into(),
                    dev: String::new(),
                }),
            ),
            (
                "an address of ours",
                v4,
                answer(RouteType::Local, vec![lo]),
                Err(NotDirect::Local { to: v4 }),
            ),
            (
                "unreachable",
                v6,
                answer(RouteType::Unreachable, vec![]),
                Err(NotDirect::NoRoute {
                    to: v6,
                    kind: "unreachable".into(),
                }),
            ),
        ];
        for (what, to, answer, want) in cases {
            assert_eq!(verdict(to, &answer, &["lo".into()], true), want, "{what}");
            // A tunnel's outer packets may take a router; nothing else changes.
            let tunnel = match want {
                Err(NotDirect::Routed { .. }) => Ok(()),
                other => other,
            };
            assert_eq!(
                verdict(to, &answer, &["lo".into()], false),
                tunnel,
                "{what}, tunnel"
            );
        }
        // Through a router out of an interface the program is not attached to.
        let mut routed = answer(RouteType::Unicast, vec![RouteAttribute::Oif(1)]);
        routed.attributes.push(RouteAttribute::Gateway(gw4.clone()));
        assert_eq!(
            verdict(v4, &routed, &["eth0".into()], false),
            Err(NotDirect::Unattached {
                to: v4,
                dev: "lo".into()
            })
        );
        // Interface 1 is the loopback in every namespace.
        let on_lo = answer(RouteType::Unicast, vec![RouteAttribute::Oif(1)]);
        let mut leg_on_lo = RouteNextHop::default();
        leg_on_lo.interface_index = 1;
        let paths = answer(
            RouteType::Unicast,
            vec![RouteAttribute::MultiPath(vec![
                RouteNextHop::default(),
                leg_on_lo,
            ])],
        );
        for (what, answer) in [("on a link", on_lo), ("one of several paths", paths)] {
            assert_eq!(verdict(v4, &answer, &["lo".into()], true), Ok(()), "{what}");
            assert_eq!(
                verdict(v4, &answer, &["eth0".into()], true),
                Err(NotDirect::Unattached {
                    to: v4,
                    dev: "lo".into()
                }),
                "{what} the program is not attached to"
            );
        }
    }

    #[test]
    fn the_message_names_the_router_and_the_link() {
        let e = NotDirect::Routed {
            to: "10.4.0.14".parse().unwrap(),
            router: "10.4.0.13".into(),
            dev: " (dev g1)".into(),
        };
        let text = e.to_string();
        assert!(
            text.contains("through the router 10.4.0.13 (dev g1)"),
            "{text}"
        );
    }
}
