#!/usr/bin/env bash
# Prints the home of a Java 17 (what Spark 3.5 and 4.x both run on), so nobody has to set JAVA_HOME.
# Looks at the registered alternatives and at `java` on PATH; when none is 17 and we are root,
# installs Debian's openjdk-17-jre-headless first. Exits 1 (with a message) when there is none.
set -u
find17() {
  local j v
  for j in ${JAVA_HOME:+"$JAVA_HOME/bin/java"} $(update-alternatives --list java 2>/dev/null) $(command -v java); do
    [ -x "$j" ] || continue
    v=$("$j" -XshowSettings:properties -version 2>&1 | awk -F'= ' '/java.specification.version/ {print $2}')
    if [ "$v" = 17 ]; then dirname "$(dirname "$(readlink -f "$j")")"; return 0; fi
  done
  return 1
}
find17 && exit 0
if [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless; } >&2
  find17 && exit 0
fi
echo "no Java 17 found: install openjdk-17-jre-headless (Spark 3.5 and 4.x run on Java 17)" >&2
exit 1
