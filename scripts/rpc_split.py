#!/usr/bin/env python3
"""Splits the first two Converts of each fresh daemon in wprep_rpc_bench output into the
way in (client send -> handler start), the handler, and the way out (handler end ->
client receive), from the bench's wall-clock stamps and the daemon's request log (one
host, one clock; the log's ts is the end of the handler). Times in microseconds.
Usage: scripts/rpc_split.py rpc_bench.txt [...]"""
import re,sys,datetime
def ts_us(t):
    d=datetime.datetime.strptime(t,"%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc)
    return d.timestamp()*1e6
for f in sys.argv[1:]:
    lines=open(f).read().split('\n')
    # segments: each label's call1/call2 lines followed (for fresh daemons) by fresh_daemon_log lines
    i=0
    while i<len(lines):
        m=re.match(r'(\S+)_call1_sent_unix_us (\d+) received_unix_us (\d+)',lines[i])
        if not m: i+=1; continue
        label=m.group(1); s1,r1=int(m.group(2)),int(m.group(3))
        if 'fresh' not in label:  # only the fresh daemons' logs are printed call by call
            i+=2; continue
        m2=re.match(r'\S+_call2_sent_unix_us (\d+) received_unix_us (\d+)',lines[i+1]); s2,r2=int(m2.group(1)),int(m2.group(2))
        # find fresh_daemon_log (or daemon_log) Convert lines after
        conv=[]
        prefix='fresh_daemon_log'
        for l in lines[i+2:]:
            if re.match(r'\S+_call1_sent',l): break
            if l.startswith(prefix) and 'method=Convert' in l:
                t=re.search(r'ts=(\S+)',l).group(1); sec=float(re.search(r' seconds=([0-9.e-]+)',l).group(1))
                conv.append((ts_us(t),sec*1e6))
                if len(conv)==2: break
        if len(conv)<2: i+=2; continue
        out=[]
        for (s,r),(end,dur) in zip([(s1,r1),(s2,r2)],conv):
            start=end-dur
            out.append("in %5.0f handler %5.0f out %5.0f total %5.0f" % (start-s, dur, r-end, r-s))
        print(f.split('/')[-1], label, "| first:", out[0], "| second:", out[1])
        i+=2
