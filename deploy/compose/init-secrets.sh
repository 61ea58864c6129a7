#!/bin/sh
# The compose stack's secrets and volume ownership, made by its one-shot `init` service
# (deploy/compose.yaml) on `docker compose up`, before anything that reads them starts.
# Under ROOT (the first argument, default /ripples-init), one volume each, laid out as
# deploy/k8s's Secrets are:
#
#   token/token                     the run's token: coordinator, agents, submit, Prometheus
#   read-token/token                the read-only token: coordinator, dashboard, Prometheus
#   tls/tls.crt, tls.key, ca.crt    the coordinator's certificate and key, and their CA
#   tls-ca/ca.crt                   the CA alone, for the clients (never the key)
#   coordinator-state/, agent-output/   only handed to the image's user
#
# Existing secrets are kept, so the stack comes back with the same ones (`docker compose
# down -v` drops them); the certificate and its CA are made again when the certificate
# no longer verifies against the clients' CA or expires within 30 days. The CA's key
# lives only while this script runs: nothing else needs it.
#
# Runs as root (fresh named volumes are root's) in the Ripples image and hands the files
# to its user, 10001 (RIPPLES_OWNER); Prometheus reads the tokens as a member of group
# 10001 (compose's group_add). Tokens come from Python's `secrets`, the certificates from
# openssl (in python:3.11-slim as a dependency of ca-certificates). Run as another user
# (tests), it makes the same files and changes no owner.
set -eu

root=${1:-/ripples-init}
owner=${RIPPLES_OWNER:-10001:10001}
# The names clients dial: the compose service and its alias (Prometheus' config is
# deploy/k8s's, which names `ripples-coordinator`), and localhost for clients on the
# Docker host through the published port.
names=${RIPPLES_TLS_NAMES:-DNS:coordinator,DNS:ripples-coordinator,DNS:localhost,IP:127.0.0.1}
days=825
umask 077

for dir in token read-token tls tls-ca coordinator-state agent-output; do
    if [ ! -d "$root/$dir" ]; then
        echo "init-secrets: $root/$dir is missing: mount the volume there" >&2
        exit 1
    fi
done

as_owner() {  # as_owner MODE PATH...: this mode, and the image's user when run as root
    mode=$1
    shift
    chmod "$mode" "$@"
    if [ "$(id -u)" = 0 ]; then
        chown "$owner" "$@"
    fi
}

put_token() {  # put_token FILE: a fresh token, unless FILE holds one
    if [ -s "$1" ]; then
        return 0
    fi
    python3 -c 'import secrets; print(secrets.token_hex(32))' > "$1.new"
    mv "$1.new" "$1"
    echo "init-secrets: made $1"
}

put_token "$root/token/token"
put_token "$root/read-token/token"
if [ "$(cat "$root/token/token")" = "$(cat "$root/read-token/token")" ]; then
    echo "init-secrets: the two tokens are equal: remove one and run again" >&2
    exit 1
fi

tls=$root/tls
ca=$root/tls-ca
if [ -s "$tls/tls.key" ] && [ -s "$ca/ca.crt" ] \
        && openssl verify -CAfile "$ca/ca.crt" "$tls/tls.crt" > /dev/null 2>&1 \
        && openssl x509 -checkend 2592000 -noout -in "$tls/tls.crt" > /dev/null; then
    echo "init-secrets: keeping the certificate in $tls"
else
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    # A configuration of its own: the extensions must not depend on the image's openssl.cnf.
    cat > "$work/openssl.cnf" <<CNF
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = $names
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
CNF
    openssl req -x509 -new -nodes -config "$work/openssl.cnf" -extensions ca \
        -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 -days "$days" \
        -subj "/CN=ripples compose CA" -keyout "$work/ca.key" -out "$work/ca.crt" 2> /dev/null
    openssl req -new -nodes -config "$work/openssl.cnf" \
        -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 \
        -subj "/CN=coordinator" -keyout "$work/tls.key" -out "$work/tls.csr" 2> /dev/null
    openssl x509 -req -in "$work/tls.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
        -CAcreateserial -sha256 -days "$days" -extfile "$work/openssl.cnf" \
        -extensions server -out "$work/tls.crt" 2> /dev/null
    cp "$work/tls.key" "$tls/tls.key.new"
    cp "$work/tls.crt" "$tls/tls.crt.new"
    cp "$work/ca.crt" "$tls/ca.crt.new"
    cp "$work/ca.crt" "$ca/ca.crt.new"
    for f in "$tls/tls.key" "$tls/tls.crt" "$tls/ca.crt" "$ca/ca.crt"; do
        mv "$f.new" "$f"
    done
    echo "init-secrets: made a CA and the coordinator's certificate for $names"
fi

# Owners and modes, every time (a volume restored from elsewhere gets them back).
as_owner 0440 "$root/token/token" "$root/read-token/token"
as_owner 0400 "$tls/tls.key"
as_owner 0444 "$tls/tls.crt" "$tls/ca.crt" "$ca/ca.crt"
as_owner 0750 "$root/token" "$root/read-token" "$tls" "$root/coordinator-state" \
    "$root/agent-output"
as_owner 0755 "$ca"
