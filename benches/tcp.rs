//! The TCP transport against a plain socket copy of the same bytes, measured
//! in the same run: RDMA-style writes of 1 MiB to 64 MiB from registered
//! memory into a peer's exposed region, and the same bytes through a
//! loopback socket with `write_all`/`read_exact` into a reused buffer.
//! Goal: the transport within 0.9x of the plain copy.

use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpu_rdma::{Access, ConnectOptions, Domain, DomainConfig, TransportPolicy};

const SIZES: [usize; 4] = [1 << 20, 4 << 20, 16 << 20, 64 << 20];

fn transport_writes(c: &mut Criterion) {
    let d = Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).unwrap();
    let max = *SIZES.iter().max().unwrap();
    let target = d.expose(d.alloc(max).unwrap(), Access::REMOTE_WRITE, 1).unwrap();
    let listener = d.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let opts = ConnectOptions::default().advertise(&target);
    let server = thread::spawn(move || listener.accept(&opts).unwrap());
    let client = d.connect(addr, &ConnectOptions::default()).unwrap();
    let _server = server.join().unwrap();
    let remote = client.remote_region(1).unwrap();
    let mut src = Some(d.alloc(max).unwrap());
    src.as_mut().unwrap().fill(7);

    let mut g = c.benchmark_group("write");
    for &size in &SIZES {
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::new("gpu-rdma tcp", size), &size, |b, &size| {
            b.iter(|| {
                let buf = src.take().unwrap();
                let (_, buf) =
                    client.write(buf.slice(..size), &remote.slice(0..size as u64).unwrap()).finish().unwrap();
                src = Some(buf);
            })
        });
        g.bench_with_input(BenchmarkId::new("plain socket", size), &size, |b, &size| {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let a = l.local_addr().unwrap();
            let rx = thread::spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                let mut buf = vec![0u8; size];
                let mut ack = [1u8];
                while s.read_exact(&mut buf).is_ok() {
                    black_box(&buf);
                    if s.write_all(&ack).is_err() {
                        break;
                    }
                    ack[0] ^= 1;
                }
            });
            let mut s = TcpStream::connect(a).unwrap();
            s.set_nodelay(true).unwrap();
            let data = vec![7u8; size];
            let mut ack = [0u8];
            b.iter(|| {
                // The same bytes, then the receiver's acknowledgement, as a write completion.
                s.write_all(&data).unwrap();
                s.read_exact(&mut ack).unwrap();
            });
            drop(s);
            rx.join().unwrap();
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = transport_writes
}
criterion_main!(benches);
