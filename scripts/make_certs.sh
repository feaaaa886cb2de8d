#!/usr/bin/env bash
# Make self-signed TLS certificates and SuperNode authentication keys for a
# local trial of a secure dpfl deployment (docs/deploy.md).
#
#   scripts/make_certs.sh [OUT_DIR] [NUM_SUPERNODES] [EXTRA_SAN ...]
#
#   OUT_DIR         where to write (default: certificates); must not hold a ca.key yet
#   NUM_SUPERNODES  how many SuperNode key pairs to make (default: 3)
#   EXTRA_SAN       more names the SuperLink is reached by, e.g. IP:192.168.1.20 DNS:server.lan
#                   (127.0.0.1, ::1 and localhost are always included: the SuperLink's own
#                   SuperExec connects to it on the loopback address)
#
# Writes:
#   OUT_DIR/ca.crt, ca.key              a self-signed certificate authority (CA)
#   OUT_DIR/server.pem, server.key      the SuperLink's certificate (signed by the CA) and key
#   OUT_DIR/supernode-<i>, .pub         SuperNode i's authentication key pair (ECDSA P-384,
#                                       OpenSSH format), i = 0 .. NUM_SUPERNODES-1
#
# SuperLink:  --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key
# SuperNode:  --root-certificates ca.crt --auth-supernode-private-key supernode-<i>
# flwr CLI:   root-certificates = "<absolute path of ca.crt>" in the connection, and
#             `flwr supernode register supernode-<i>.pub <connection>` for each SuperNode.
#
# For a trial only: on real devices each SuperNode makes its own key pair and keeps
# the private key; only the .pub file travels to whoever registers it.
set -euo pipefail

out_dir="${1:-certificates}"
num_supernodes="${2:-3}"
shift $(( $# > 2 ? 2 : $# ))
extra_san=("$@")

for tool in openssl ssh-keygen; do
    if ! command -v "$tool" > /dev/null; then
        echo "error: $tool is not installed" >&2
        exit 1
    fi
done
if ! [[ "$num_supernodes" =~ ^[0-9]+$ ]]; then
    echo "error: NUM_SUPERNODES must be a whole number, got '$num_supernodes'" >&2
    exit 2
fi
if [[ -e "$out_dir/ca.key" ]]; then
    echo "error: $out_dir/ca.key exists; remove $out_dir or choose another folder" >&2
    exit 2
fi
san="DNS:localhost,IP:127.0.0.1,IP:::1"
for entry in "${extra_san[@]}"; do
    case "$entry" in
        IP:* | DNS:*) san="$san,$entry" ;;
        *)
            echo "error: EXTRA_SAN entries look like IP:1.2.3.4 or DNS:host.name, got '$entry'" >&2
            exit 2
            ;;
    esac
done

mkdir -p "$out_dir"
chmod 700 "$out_dir"

# 1. The certificate authority.
openssl req -x509 -newkey rsa:3072 -nodes -sha256 -days 365 \
    -keyout "$out_dir/ca.key" -out "$out_dir/ca.crt" \
    -subj "/CN=dpfl local trial CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2> /dev/null

# 2. The SuperLink's certificate, for every name it is reached by.
openssl req -newkey rsa:3072 -nodes -sha256 \
    -keyout "$out_dir/server.key" -out "$out_dir/server.csr" \
    -subj "/CN=dpfl SuperLink" 2> /dev/null
extensions="$(mktemp)"
trap 'rm -f "$extensions"' EXIT
cat > "$extensions" << EOF
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = $san
EOF
openssl x509 -req -in "$out_dir/server.csr" -CA "$out_dir/ca.crt" -CAkey "$out_dir/ca.key" \
    -CAcreateserial -out "$out_dir/server.pem" -days 365 -sha256 -extfile "$extensions" 2> /dev/null
rm -f "$out_dir/server.csr" "$out_dir/ca.srl"
openssl verify -CAfile "$out_dir/ca.crt" "$out_dir/server.pem" > /dev/null

# 3. One authentication key pair per SuperNode (NIST P-384, OpenSSH format, no passphrase).
for ((i = 0; i < num_supernodes; i++)); do
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "dpfl-supernode-$i" -f "$out_dir/supernode-$i"
done
chmod 600 "$out_dir"/*.key
if [[ "$num_supernodes" -gt 0 ]]; then
    chmod 600 "$out_dir"/supernode-*[0-9]
fi

echo "wrote to $out_dir: ca.crt ca.key server.pem server.key (SAN $san)" \
    "and $num_supernodes SuperNode key pairs supernode-<i>[.pub]"
