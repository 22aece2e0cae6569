#!/usr/bin/env python3
"""The server's layers, checked (ctest: server_layers).

server/src is four layers, lowest first: net, device, exec, rpc; the daemon (the files
directly in server/src, and server/main.cc) is on top. Fails, naming each problem, when
  - a file includes a header of a higher layer, or a layer's header without its
    "<layer>/" prefix, or climbs out of its folder ("../");
  - a layer includes the daemon's lifecycle (wprep/server/daemon.h); its options
    (wprep/server/options.h) are for every layer;
  - server/src has an include cycle (a file and its header count as one unit, so
    a.cc -> b.h -> a.h is a cycle);
  - server/CMakeLists.txt links a layer's library to anything but the layer just below.
With --config (ctest: config_header), instead: fails on a C++ file of the project that tests
WPREP_HAVE_CUDA without including "wprep/config.h" (where it is always defined, to 0 or
1; a file without it would read 0 and silently build without CUDA), or tests it with
#ifdef or defined().
Usage: check_layers.py [--config] [repository root]
"""
import os
import re
import sys

LAYERS = ["net", "device", "exec", "rpc"]
DAEMON = "daemon"
RANK = {name: i for i, name in enumerate(LAYERS + [DAEMON])}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of(rel):
    """The layer of a path relative to server/src, or DAEMON for the top folder."""
    head = rel.split("/", 1)[0]
    return head if head in LAYERS else DAEMON


def server_files(root):
    src = os.path.join(root, "server", "src")
    files = {}
    for dirpath, _, names in os.walk(src):
        for name in names:
            if name.endswith((".h", ".cc")):
                path = os.path.join(dirpath, name)
                files[os.path.relpath(path, src)] = path
    return files


def check_includes(files):
    problems = []
    edges = {}
    headers = {rel for rel in files if rel.endswith(".h")}
    bare = {os.path.basename(rel): rel for rel in headers}
    for rel, path in sorted(files.items()):
        mine = layer_of(rel)
        unit = os.path.splitext(rel)[0]
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for inc in INCLUDE.findall(text):
            where = f"server/src/{rel}: #include \"{inc}\""
            if ".." in inc.split("/"):
                problems.append(f"{where} climbs out of its folder")
                continue
            if inc == "wprep/server/daemon.h" and mine != DAEMON:
                problems.append(f"{where}: the {mine} layer includes the daemon's lifecycle")
                continue
            if inc in headers:
                theirs = layer_of(inc)
                if inc.count("/") != 1 or theirs == DAEMON:
                    problems.append(f"{where}: not a layer's header")
                elif RANK[theirs] > RANK[mine]:
                    problems.append(f"{where}: the {mine} layer includes the higher {theirs} layer")
                edges.setdefault(unit, set()).add(os.path.splitext(inc)[0])
            elif "/" not in inc and inc in bare:
                problems.append(f"{where}: name it \"{bare[inc]}\" (the layer's prefix)")
    return problems, edges


def find_cycle(edges):
    """One include cycle among units, as a list of units, or None."""
    state = {}
    stack = []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if v == u:
                continue  # a file including its own header
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(edges):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def check_links(root):
    """Each layer's target_link_libraries names only the layer just below."""
    problems = []
    path = os.path.join(root, "server", "CMakeLists.txt")
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"#[^\n]*", "", f.read())
    for target, body in re.findall(r"target_link_libraries\(\s*(wprep_server_\w+)([^)]*)\)", text):
        name = target[len("wprep_server_"):]
        if name not in LAYERS:
            continue
        below = LAYERS[RANK[name] - 1] if RANK[name] > 0 else None
        for other in re.findall(r"\bwprep_server_(\w+)\b", body):
            if other in LAYERS and other != below:
                problems.append(f"server/CMakeLists.txt: wprep_server_{name} links wprep_server_{other}"
                                f" (it may link only {'wprep_server_' + below if below else 'no layer'})")
            if other not in LAYERS and other != "options":
                problems.append(f"server/CMakeLists.txt: wprep_server_{name} links wprep_server_{other}")
        if re.search(r"\bwprep(::|_)server\b(?!_)", body):
            problems.append(f"server/CMakeLists.txt: wprep_server_{name} links the daemon library")
    return problems


CONFIG_MACROS = ["WPREP_HAVE_CUDA"]
CONFIG_FOLDERS = ["spec", "flags", "kernels", "proto", "server", "client", "tests", "bench"]


def check_config(root):
    problems = []
    count = 0
    for folder in CONFIG_FOLDERS:
        for dirpath, _, names in os.walk(os.path.join(root, folder)):
            for name in sorted(names):
                if not name.endswith((".h", ".cc", ".cu", ".cuh")):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                for macro in CONFIG_MACROS:
                    tests = re.findall(r"^\s*#\s*(?:if|ifdef|ifndef|elif)\b[^\n]*\b" + macro + r"\b[^\n]*",
                                       text, re.M)
                    if not tests:
                        continue
                    count += 1
                    if '#include "wprep/config.h"' not in text:
                        problems.append(f"{rel}: tests {macro} without #include \"wprep/config.h\"")
                    for line in tests:
                        if re.search(r"#\s*if(n)?def\b|defined\s*\(?\s*" + macro, line):
                            problems.append(f"{rel}: '{line.strip()}': test it with #if (always 0 or 1)")
    return problems, count


def main():
    args = sys.argv[1:]
    config = "--config" in args
    args = [a for a in args if a != "--config"]
    root = args[0] if args else os.path.join(os.path.dirname(__file__), "..")
    if config:
        problems, count = check_config(root)
        for p in problems:
            print(p)
        if problems:
            print(f"check_layers --config: {len(problems)} problem(s)")
            return 1
        print(f"check_layers --config: {count} files test the build's configuration, each through wprep/config.h")
        return 0
    files = server_files(root)
    if not any(layer_of(rel) == "net" for rel in files):
        print("check_layers: no server/src/net; wrong root?")
        return 2
    problems, edges = check_includes(files)
    cycle = find_cycle(edges)
    if cycle:
        problems.append("include cycle in server/src: " + " -> ".join(cycle))
    problems += check_links(root)
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} problem(s)")
        return 1
    print(f"check_layers: {len(files)} files in {len(LAYERS)} layers and the daemon, clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
