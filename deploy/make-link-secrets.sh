#!/bin/sh
# Make the gateway <-> agent link's secrets for docker-compose.yml (docs/security.md, docs/gpu-hosts.md).
#
#   deploy/make-link-secrets.sh [--tls] [DIR]
#
# Writes into DIR (default: deploy/secrets, next to this script), never replacing a file; keys and the token
# mode 0600, certificates 0644:
#   agent-link-token          the bearer token: 64 hex digits from `openssl rand` (always)
# With --tls also (EC P-256 keys; certificates valid AGENT_LINK_DAYS days, default 825):
#   link-ca.crt / .key        a private CA; keep link-ca.key off the hosts once the certificates are made
#   agent.crt / agent.key     the agents' certificate: DNS names agent-0 .. agent-7 (AGENT_LINK_NAMES, space-separated,
#                             overrides them), localhost and IP 127.0.0.1; serverAuth and clientAuth (the healthcheck
#                             of deploy/compose.tls.yml presents it to its own agent under mutual TLS)
#   gateway.crt / gateway.key the gateway's client certificate (clientAuth), for mutual TLS
# Needs the openssl command (1.1.1 or later).
set -eu

tls=0
dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tls) tls=1 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    -*) echo "$0: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) dir=$1 ;;
  esac
  shift
done
dir=${dir:-$(dirname "$0")/secrets}
command -v openssl >/dev/null || { echo "$0: needs the openssl command" >&2; exit 1; }
umask 077
mkdir -p "$dir"

if [ -e "$dir/agent-link-token" ]; then
  echo "kept $dir/agent-link-token (it exists; delete it to make a new token)"
else
  openssl rand -hex 32 > "$dir/agent-link-token"
  echo "wrote $dir/agent-link-token"
fi

if [ "$tls" = 1 ]; then
  for f in link-ca.crt link-ca.key agent.crt agent.key gateway.crt gateway.key; do
    if [ -e "$dir/$f" ]; then
      echo "$0: $dir/$f exists; remove the TLS files to make new ones" >&2
      exit 1
    fi
  done
  days=${AGENT_LINK_DAYS:-825}
  names=${AGENT_LINK_NAMES:-"agent-0 agent-1 agent-2 agent-3 agent-4 agent-5 agent-6 agent-7"}
  san="DNS:localhost,IP:127.0.0.1"
  for name in $names; do san="$san,DNS:$name"; done
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT

  key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
  subject() { printf '[req]\nprompt = no\ndistinguished_name = dn\n[dn]\nCN = %s\n' "$1"; }

  key "$dir/link-ca.key"
  { subject "switchyard link CA"
    printf '[ca]\nbasicConstraints = critical, CA:true\nkeyUsage = critical, keyCertSign, cRLSign\n'
    printf 'subjectKeyIdentifier = hash\n'; } > "$tmp/ca.cnf"
  openssl req -x509 -new -key "$dir/link-ca.key" -sha256 -days "$days" -config "$tmp/ca.cnf" -extensions ca \
    -out "$dir/link-ca.crt"

  leaf() {  # leaf NAME COMMON-NAME EXTENDED-KEY-USAGE [SUBJECT-ALT-NAMES]
    key "$dir/$1.key"
    subject "$2" > "$tmp/$1.cnf"
    openssl req -new -key "$dir/$1.key" -config "$tmp/$1.cnf" -out "$tmp/$1.csr"
    { printf 'basicConstraints = critical, CA:false\nkeyUsage = critical, digitalSignature\n'
      printf 'extendedKeyUsage = %s\nauthorityKeyIdentifier = keyid\n' "$3"
      if [ -n "${4:-}" ]; then printf 'subjectAltName = %s\n' "$4"; fi; } > "$tmp/$1.ext"
    openssl x509 -req -in "$tmp/$1.csr" -CA "$dir/link-ca.crt" -CAkey "$dir/link-ca.key" \
      -CAcreateserial -CAserial "$tmp/ca.srl" -sha256 -days "$days" -extfile "$tmp/$1.ext" \
      -out "$dir/$1.crt" 2>/dev/null
  }
  leaf agent "switchyard agent" "serverAuth, clientAuth" "$san"
  leaf gateway "switchyard gateway" "clientAuth"
  chmod 0644 "$dir/link-ca.crt" "$dir/agent.crt" "$dir/gateway.crt"  # certificates are public
  echo "wrote $dir/link-ca.crt, agent.crt/.key (names: $names, localhost, 127.0.0.1), gateway.crt/.key"
  echo "move $dir/link-ca.key somewhere safe: it is needed only to issue new certificates"
fi
gateway_reads="$dir/agent-link-token"
if [ "$tls" = 1 ]; then gateway_reads="$gateway_reads $dir/gateway.key"; fi
echo "the gateway container runs as uid 10001 and Compose applies no uid or mode to file secrets: let it read"
echo "its files, e.g. \`sudo chown 10001 $gateway_reads\` (the agents run as root)"
