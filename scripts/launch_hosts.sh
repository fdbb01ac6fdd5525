# shellcheck shell=bash
# Sourced by scripts/launch.sh: the hosts and ranks a launch runs on, read as deepspeed's runner reads them (a
# hostfile's lines, then --include/--exclude and --num_nodes). Reads launch.sh's hostfile, include, exclude, num_nodes.
# shellcheck disable=SC2154  # every variable named above is launch.sh's

host_lines() { { grep -v '^\s*#' "$hostfile" || true; } | sed 's/#.*//' | awk 'NF'; }  # as deepspeed reads a hostfile
# What deepspeed's runner runs on: its pool ("HOST slots=N" lines on stdin; $1 says whose) after --include/--exclude
# (NAME[:SLOT[,SLOT]][@...]) and --num_nodes, "HOST RANKS" a line in the pool's order. A name or slot not in the pool,
# or nothing left, is one line here (the runner: a traceback, or with --no_ssh an AssertionError after 20 s).
active() {
  awk -v inc="$include" -v exc="$exclude" -v top="${num_nodes:-0}" -v where="$1" '
    function no(why) { print (inc exc == "" ? "" : inc == "" ? "--exclude " exc ": " : "--include " inc ": ") why; exit 1 }
    { h[NR] = $1; n[$1] = match($0, /slots=[0-9]+/) ? substr($0, RSTART + 6, RLENGTH - 6) + 0 : 0; all = all " " $1 }
    END { if (!NR) no(where " names no host (a line \047HOST slots=N\047 per node)")
      k = split(inc exc, spec, "@")
      for (i = 1; i <= k; i++) { name = spec[i]; sub(/:.*/, "", name); m = split(substr(spec[i], length(name) + 2), s, ",")
        if (!(name in n)) no(name " is not a host of " where ": its hosts are" all)
        if ((name in seen && (!m || seen[name] == "all")) || (index(spec[i], ":") && !m)) no(name (name in seen ? \
          " is named whole and again" : " has an empty slot list") ": name it once whole, or by its slots (HOST:SLOT," \
          "SLOT; deepspeed reads this form otherwise)"); seen[name] = m ? "slots" : "all"
        for (j = 0; j < n[name] && !m; j++) pick[name, j] = 1
        for (j = 1; j <= m; j++) if (s[j] !~ /^[0-9]+$/ || s[j] + 0 >= n[name])
          no(name " has no slot " s[j] " in " where ": its slots are 0-" n[name] - 1); else pick[name, s[j] + 0] = 1 }
      for (r = 1; r <= NR && (!top || left < top); r++) { c = 0
        for (j = 0; j < n[h[r]]; j++) c += (inc exc == "") || ((inc != "") == ((h[r], j) in pick))
        if (c) { out = out h[r] " " c "\n"; left++ } }
      if (!left) no("nothing left to run on in " where)
      if (top > left) no("--num_nodes " top " but " where " has " left " hosts"); printf "%s", out }'
}
