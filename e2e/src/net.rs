//! A fault-injecting TCP proxy the test harness controls (no root needed).
//!
//! Every coordinator advertises a proxy port ("front") instead of its real gRPC port;
//! the proxy forwards to the real port. On each accepted connection the proxy finds
//! which of the harness's processes opened it (the peer's source port, looked up in
//! `/proc/net/tcp` and the processes' `/proc/<pid>/fd` links; before forwarding while a
//! link is cut, beside it otherwise, one lookup at a time), so a partition can cut
//! exactly the links between two named nodes, in both directions, while every other
//! link keeps working. Cut links close their open connections within
//! [`CHECK_INTERVAL`] and refuse new ones until healed.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// How often an open proxied connection re-checks whether its link was cut.
pub const CHECK_INTERVAL: Duration = Duration::from_millis(50);
/// Name of connections whose process the proxy cannot attribute (the test itself).
pub const UNKNOWN: &str = "client";
/// Largest number of proxied connections open at once per proxy.
pub const MAX_CONNECTIONS: usize = 1_024;

/// The network's fault state: which processes are which node, and which directed
/// links are cut. Shared by every proxy of a cluster.
#[derive(Default)]
pub struct Net {
    /// pid → node name ("c1", "w2"); updated by the harness on every (re)spawn.
    pids: Mutex<HashMap<u32, String>>,
    /// Cut directed links (from, to).
    cut: Mutex<HashSet<(String, String)>>,
    /// Connections refused or closed because of a cut, in total.
    dropped: std::sync::atomic::AtomicU64,
    /// Held while finding a connection's process ([`Net::owner_of`]): one scan at a time.
    /// A scan reads every socket of the machine and every descriptor of the registered
    /// processes (~0.1 s of CPU during a flood of thousands of sockets); run concurrently
    /// for every retried connection, the scans once took both CPUs and held every link
    /// shut for 27 s after a flood (nemesis seed 36005).
    scan: Mutex<()>,
}

impl Net {
    /// A network with no cut link.
    pub fn new() -> Arc<Net> {
        Arc::new(Net::default())
    }

    /// Records that `pid` is node `name` (forgetting any earlier pid of `name`).
    pub fn register(&self, pid: u32, name: &str) {
        let mut pids = self.pids.lock().unwrap_or_else(|p| p.into_inner());
        pids.retain(|_, n| n != name);
        pids.insert(pid, name.to_string());
    }

    /// Cuts the links between every node of `a` and every node of `b`, both ways.
    pub fn partition(&self, a: &[String], b: &[String]) {
        let mut cut = self.cut.lock().unwrap_or_else(|p| p.into_inner());
        for x in a {
            for y in b {
                cut.insert((x.clone(), y.clone()));
                cut.insert((y.clone(), x.clone()));
            }
        }
    }

    /// Restores every link.
    pub fn heal(&self) {
        self.cut.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// True when the directed link `from → to` is cut.
    pub fn is_cut(&self, from: &str, to: &str) -> bool {
        self.cut
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&(from.to_string(), to.to_string()))
    }

    /// Connections refused or closed because of a cut so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether any link is cut now.
    fn any_cut(&self) -> bool {
        !self
            .cut
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }

    /// The node that owns the local TCP socket bound to `port` on 127.0.0.1, among the
    /// registered processes ([`UNKNOWN`] when none does). Blocking; one at a time.
    fn owner_of(&self, port: u16) -> String {
        let _one_at_a_time = self.scan.lock().unwrap_or_else(|p| p.into_inner());
        let Some(inode) = socket_inode(port) else {
            return UNKNOWN.into();
        };
        let pids: Vec<(u32, String)> = self
            .pids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(p, n)| (*p, n.clone()))
            .collect();
        let want = format!("socket:[{inode}]");
        for (pid, name) in pids {
            let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
                continue;
            };
            for fd in fds.flatten() {
                if std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == want) {
                    return name;
                }
            }
        }
        UNKNOWN.into()
    }
}

/// The inode of the IPv4 TCP socket whose local address is 127.0.0.1:`port`.
fn socket_inode(port: u16) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let want = format!("0100007F:{port:04X}");
    for line in text.lines().skip(1) {
        let mut cols = line.split_whitespace();
        if cols.nth(1) != Some(want.as_str()) {
            continue;
        }
        // Column 9 is the inode; `nth(1)` consumed columns 0 and 1.
        let inode: u64 = cols.nth(7)?.parse().ok()?;
        if inode != 0 {
            return Some(inode);
        }
    }
    None
}

/// One proxy: listens on `front`, forwards to `back`, on behalf of node `name`.
pub struct Proxy {
    /// Address clients connect to (advertised as the node's address).
    pub front: SocketAddr,
    /// Where connections are forwarded (the node's real listener).
    pub back: SocketAddr,
    cancel: CancellationToken,
}

impl Proxy {
    /// Binds `front` and starts forwarding to `back` for node `name` on the current
    /// tokio runtime (call it inside one).
    ///
    /// # Errors
    /// When `front` cannot be bound.
    pub fn start(
        net: Arc<Net>,
        name: &str,
        front: SocketAddr,
        back: SocketAddr,
    ) -> std::io::Result<Proxy> {
        let std_listener = std::net::TcpListener::bind(front)?;
        std_listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(std_listener)?;
        let cancel = CancellationToken::new();
        let name = name.to_string();
        let c = cancel.clone();
        let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = c.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((inbound, peer)) = accepted else {
                    continue;
                };
                let Ok(permit) = open.clone().try_acquire_owned() else {
                    continue; // drops the connection
                };
                let net = net.clone();
                let name = name.clone();
                let c = c.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    let from: Owner = Arc::default();
                    let find = {
                        let net = net.clone();
                        let from = from.clone();
                        move || {
                            let _ = from.set(net.owner_of(peer.port()));
                        }
                    };
                    if net.any_cut() {
                        // A cut link must be refused before any byte passes.
                        if tokio::task::spawn_blocking(find).await.is_err() {
                            let _ = from.set(UNKNOWN.into());
                        }
                    } else {
                        // Nothing to refuse now: forward at once and learn the owner on the
                        // side, for the cut checks of the open connection.
                        drop(tokio::task::spawn_blocking(find));
                    }
                    forward(net, from, name, inbound, back, c).await;
                });
            }
        });
        Ok(Proxy {
            front,
            back,
            cancel,
        })
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// The process that opened a proxied connection, once found (empty until then).
type Owner = Arc<std::sync::OnceLock<String>>;

/// Forwards `inbound` to `back` until either side ends, `cancel` fires, or the link from
/// `from` to `to` is cut. A connection whose owner is not found yet counts as uncut: it was
/// accepted while no link was cut, and its owner is known within one scan.
async fn forward(
    net: Arc<Net>,
    from: Owner,
    to: String,
    inbound: TcpStream,
    back: SocketAddr,
    cancel: CancellationToken,
) {
    let cut = || from.get().is_some_and(|f| net.is_cut(f, &to));
    if cut() {
        net.dropped
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return;
    }
    let Ok(Ok(outbound)) =
        tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(back)).await
    else {
        return;
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (mut ir, mut iw) = inbound.into_split();
    let (mut or, mut ow) = outbound.into_split();
    let up = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = ir.read(&mut buf).await?;
            if n == 0 {
                ow.shutdown().await?;
                return Ok::<(), std::io::Error>(());
            }
            ow.write_all(&buf[..n]).await?;
        }
    };
    let down = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = or.read(&mut buf).await?;
            if n == 0 {
                iw.shutdown().await?;
                return Ok::<(), std::io::Error>(());
            }
            iw.write_all(&buf[..n]).await?;
        }
    };
    let watch = async {
        loop {
            tokio::time::sleep(CHECK_INTERVAL).await;
            if cut() {
                net.dropped
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return;
            }
        }
    };
    let both = async {
        let _ = tokio::join!(up, down);
    };
    tokio::select! {
        _ = both => {}
        _ = watch => {}
        _ = cancel.cancelled() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn roundtrip(front: SocketAddr) -> bool {
        let Ok(mut s) = TcpStream::connect(front).await else {
            return false;
        };
        if s.write_all(b"ping").await.is_err() {
            return false;
        }
        let mut buf = [0u8; 4];
        matches!(
            tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut buf)).await,
            Ok(Ok(_))
        ) && &buf == b"ping"
    }

    #[tokio::test]
    async fn cut_links_drop_and_heal_restores() {
        let net = Net::new();
        let back = echo_server().await;
        let front: SocketAddr = format!("127.0.0.1:{}", crate::free_port())
            .parse()
            .expect("addr");
        let _p = Proxy::start(net.clone(), "c1", front, back).expect("proxy");
        assert!(roundtrip(front).await, "an uncut link forwards");
        // This test process is not registered: it is the UNKNOWN client.
        net.partition(&[UNKNOWN.to_string()], &["c1".to_string()]);
        assert!(net.is_cut(UNKNOWN, "c1") && net.is_cut("c1", UNKNOWN));
        assert!(!roundtrip(front).await, "a cut link refuses");
        assert!(net.dropped() >= 1);
        net.heal();
        assert!(roundtrip(front).await, "a healed link forwards again");
    }

    #[tokio::test]
    async fn an_open_connection_is_closed_when_its_link_is_cut() {
        let net = Net::new();
        let back = echo_server().await;
        let front: SocketAddr = format!("127.0.0.1:{}", crate::free_port())
            .parse()
            .expect("addr");
        let _p = Proxy::start(net.clone(), "c2", front, back).expect("proxy");
        let mut s = TcpStream::connect(front).await.expect("connect");
        s.write_all(b"ping").await.expect("write");
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await.expect("echo");
        net.partition(&[UNKNOWN.to_string()], &["c2".to_string()]);
        let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
        assert!(
            matches!(r, Ok(Ok(0)) | Ok(Err(_))),
            "the connection closes: {r:?}"
        );
    }

    #[test]
    fn the_owner_of_a_socket_is_found_by_its_local_port() {
        let net = Net::default();
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        assert_eq!(net.owner_of(port), UNKNOWN);
        net.register(std::process::id(), "me");
        assert_eq!(net.owner_of(port), "me");
    }
}
