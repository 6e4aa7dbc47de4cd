#!/usr/bin/env bash
# Fetches S3Proxy (org.gaul:s3proxy, the self-contained jar) from Maven Central with Maven into DIR:
# the S3-compatible server the object-store tests start on 127.0.0.1, over a folder of this machine
# (its filesystem backend), on the Java 17 the project already uses. Installs Maven (Debian's
# package) first when it is missing and we are root.
#   tools/s3proxy_fetch.sh VERSION DIR
set -eu
version=$1 dir=$2
jar="$dir/s3proxy-$version-jar-with-dependencies.jar"
[ -s "$jar" ] && exit 0
if ! command -v mvn >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq maven; } >&2
  else
    echo "Maven (mvn) is missing: install maven to fetch S3Proxy for the object-store tests" >&2; exit 1
  fi
fi
mkdir -p "$dir"
mvn -q -B dependency:copy -Dartifact="org.gaul:s3proxy:$version:jar:jar-with-dependencies" -DoutputDirectory="$dir" >&2
[ -s "$jar" ] || { echo "S3Proxy $version: no jar in $dir" >&2; exit 1; }
