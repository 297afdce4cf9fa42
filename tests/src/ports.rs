//! Free loopback ports, never the same one twice in a process.

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::Mutex;

static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A loopback port nothing listens on now and that this process has not handed out.
pub fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("binding an ephemeral loopback port")
            .port();
        let mut seen = HANDED_OUT.lock().expect("port set");
        if seen.get_or_insert_with(HashSet::new).insert(port) {
            return port;
        }
    }
}
