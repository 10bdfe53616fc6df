#!/usr/bin/env python3
"""What closing a SO_REUSEPORT listener costs its clients, against keeping it open.

Why inferd keeps one socket per slot across worker replacements (docs/architecture.md,
"Sockets"): Linux resets a connection whose handshake completes just as its listener closes,
even with net.ipv4.tcp_migrate_req=1, which moves only connections already queued.

Two listeners share a port. A "stable" process accepts on one for the whole run. A "churn"
process plays a worker being replaced again and again: in mode `close` it opens a new listener,
accepts on it for 30 ms and closes it (each worker with a socket of its own); in mode `keep` it
accepts on one socket that stays open, pausing 5 ms between its 30 ms turns (a slot's socket
that its successive workers share). Client processes open a new connection per request, send a
byte and read the answer to its end. Both modes run one after the other, and the kernel's
counters (nstat) are printed for each.

    python3 bench/listener_close.py [--seconds 20] [--clients 3]

Measured on 2 cores (AMD EPYC, Linux 6.18, tcp_migrate_req=1), 20 s each, two sittings:
close: 218,965 answered, 2 reset (TcpOutRsts 2, TcpEstabResets 2, 418 migrations), then
223,493 answered, 1 reset (439 migrations); keep: 208,914 and 161,937 answered, 0 failed.
"""
import argparse
import multiprocessing as mp
import socket
import subprocess
import time


def listener(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen(1024)
    return s


def answer(conn):
    try:
        conn.settimeout(2)
        conn.recv(100)
        conn.sendall(b"ok")
        conn.close()
    except OSError:
        pass


def accept_for(sock, seconds, stop):
    sock.settimeout(0.01)
    until = time.monotonic() + seconds
    while time.monotonic() < until and not stop.is_set():
        try:
            conn, _ = sock.accept()
        except socket.timeout:
            continue
        answer(conn)


def stable(sock, stop):
    while not stop.is_set():
        accept_for(sock, 0.1, stop)


def churn(port, mode, stop):
    kept = listener(port) if mode == "keep" else None
    while not stop.is_set():
        sock = kept or listener(port)
        accept_for(sock, 0.03, stop)
        if kept is None:
            sock.close()
        else:
            time.sleep(0.005)


def client(port, stop, results):
    answered = failed = 0
    while not stop.is_set():
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=5)
            conn.sendall(b"x")
            data = b""
            while chunk := conn.recv(16):
                data += chunk
            conn.close()
            answered += data == b"ok"
            failed += data != b"ok"
        except OSError:
            failed += 1
    results.put((answered, failed))


def nstat():
    out = subprocess.run(["nstat"], capture_output=True, text=True).stdout
    wanted = ("TcpOutRsts", "TcpEstabResets", "TcpExtTCPMigrateReq", "TcpExtListenDrops")
    return " ".join(f"{f[0]}={f[1]}" for f in (l.split() for l in out.splitlines()) if f and f[0].startswith(wanted))


def run(mode, seconds, clients):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    stop, results = mp.Event(), mp.Queue()
    stable_socket = listener(port)
    procs = [mp.Process(target=stable, args=(stable_socket, stop)), mp.Process(target=churn, args=(port, mode, stop))]
    procs += [mp.Process(target=client, args=(port, stop, results)) for _ in range(clients)]
    subprocess.run(["nstat", "-n"], check=False)
    for p in procs:
        p.start()
    time.sleep(seconds)
    stop.set()
    totals = [results.get() for _ in range(clients)]
    for p in procs:
        p.join()
    answered, failed = (sum(t[i] for t in totals) for i in (0, 1))
    print(f"{mode}: {answered} answered, {failed} failed; kernel: {nstat() or 'nothing counted'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--clients", type=int, default=3)
    args = parser.parse_args()
    with open("/proc/sys/net/ipv4/tcp_migrate_req") as f:
        print(f"net.ipv4.tcp_migrate_req = {f.read().strip()}")
    for mode in ("close", "keep"):
        run(mode, args.seconds, args.clients)


if __name__ == "__main__":
    main()
