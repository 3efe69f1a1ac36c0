#!/usr/bin/env python3
"""Helpers of scripts/api-fuzz.sh (standard library only).

  api-fuzz-helper.py bridge SOCKET PORT_FILE
      Forwards TCP connections on 127.0.0.1 (a free port, written to
      PORT_FILE once listening) to the Unix socket SOCKET, byte for byte,
      until killed: schemathesis speaks TCP, the VMM's API a Unix socket.
  api-fuzz-helper.py kernel PATH
      Writes a minimal ELF "kernel" with a PVH entry note whose code halts
      forever (the same bytes as vmm/tests/common's halting_kernel).
  api-fuzz-helper.py call SOCKET METHOD ACTION [JSON] [EXPECTED_STATUS]
      One request to /api/v1/ACTION on SOCKET; prints status and body; exits
      1 unless the status is EXPECTED_STATUS (default: any 2xx).
"""

import http.client
import os
import socket
import socketserver
import struct
import sys
import threading


def pump(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def bridge(sock_path, port_file):
    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            with socket.socket(socket.AF_UNIX) as upstream:
                upstream.connect(sock_path)
                back = threading.Thread(target=pump, args=(upstream, self.request))
                back.start()
                pump(self.request, upstream)
                back.join()

    socketserver.ThreadingTCPServer.daemon_threads = True
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler) as server:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(server.server_address[1]))
        # Renamed into place: the script never reads half a number.
        os.rename(port_file + ".tmp", port_file)
        server.serve_forever()


def kernel(path):
    load = 0x10_0000
    code = bytes([0xF4, 0xEB, 0xFD])  # hlt; jmp back to the hlt
    # ELF header: 64-bit, little-endian, executable, x86-64, 2 program headers.
    e = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    e += struct.pack("<HHIQQQIHHHHHH", 2, 0x3E, 1, load, 64, 0, 0, 64, 56, 2, 64, 0, 0)
    # PT_LOAD of the code, PT_NOTE of the PVH entry.
    e += struct.pack("<IIQQQQQQ", 1, 5, 0x1000, load, load, len(code), len(code), 0x1000)
    e += struct.pack("<IIQQQQQQ", 4, 4, 176, 0, 0, 20, 20, 4)
    # Note: namesz 4, descsz 4, type XEN_ELFNOTE_PHYS32_ENTRY (18), "Xen", entry.
    e += struct.pack("<III", 4, 4, 18) + b"Xen\0" + struct.pack("<I", load)
    e = e.ljust(0x1000, b"\0") + code
    with open(path, "wb") as f:
        f.write(e)


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=60)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def call(sock_path, method, action, body=None, expected=None):
    conn = UnixConnection(sock_path)
    headers = {"Content-Type": "application/json"} if body else {}
    conn.request(method, "/api/v1/" + action, body=body or None, headers=headers)
    r = conn.getresponse()
    text = r.read().decode(errors="replace")
    print(f"{method} {action}: {r.status} {text}".rstrip())
    ok = r.status == int(expected) if expected else 200 <= r.status < 300
    sys.exit(0 if ok else 1)


def main(argv):
    if len(argv) == 3 and argv[0] == "bridge":
        bridge(argv[1], argv[2])
    elif len(argv) == 2 and argv[0] == "kernel":
        kernel(argv[1])
    elif 4 <= len(argv) <= 6 and argv[0] == "call":
        call(*argv[1:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
