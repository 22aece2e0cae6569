#!/usr/bin/env bash
# Fails `make test-tsan` when any process of the run left a ThreadSanitizer log in DIR
# (TSAN_OPTIONS log_path=DIR/report log_exe_name=1: one file per process, named
# report.<program>.<pid>). Each log is printed whole under its name and size, and the
# reports' one-line summaries come last, so that the end of a CI log names every race.
set -u
dir=${1:?usage: tsan_reports.sh DIR}
shopt -s nullglob
logs=("$dir"/report.*)
[ ${#logs[@]} -eq 0 ] && exit 0
for f in "${logs[@]}"; do
  size=$(stat -c %s "$f")
  echo "==== $(basename "$f") ($size bytes)"
  if [ "$size" -eq 0 ]; then
    echo "(empty: the process opened its ThreadSanitizer log and ended before writing to it)"
  else
    cat "$f"
  fi
done
echo "==== test-tsan: ${#logs[@]} ThreadSanitizer log(s):"
for f in "${logs[@]}"; do
  summary=$(grep -h -m3 -E '^SUMMARY:|WARNING: ThreadSanitizer|ERROR: ThreadSanitizer' "$f" | tr '\n' ' ')
  echo "  $(basename "$f"): ${summary:-no summary line}"
done
echo "test-tsan: ThreadSanitizer reports above"
exit 1
