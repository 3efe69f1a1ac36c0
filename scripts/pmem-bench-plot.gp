# Plot of scripts/bench-pmem.sh's results (the plot-*.dat files the
# benchmark writes). Usage:
#   gnuplot -e "dir='RESULTS_DIR'; out='FILE.png'" scripts/pmem-bench-plot.gp
if (!exists("dir")) dir = "target/pmem-bench"
if (!exists("out")) out = dir."/pmem-benchmarks.png"

set terminal pngcairo size 1500,1650 font "DejaVu Sans,11" noenhanced
set output out
set datafile separator "\t"
set datafile missing "-"
set datafile columnheaders
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border rgb "#333333"
set boxwidth 0.9
set grid ytics lc rgb "#dddddd"
set key outside right top vertical Left reverse samplen 1.5 width -2
set xtics nomirror
set ytics nomirror
set border 3

set multiplot layout 3,1 title "pcow virtio-pmem region vs raw mapping vs qcow2 (scripts/bench-pmem.sh)" font ",14"

# 1. Latencies (p50; qemu-img bench: mean per request).
stats dir."/plot-latency.dat" using 2 nooutput
ncases = STATS_records + STATS_invalid
set xrange [-0.5:ncases - 0.5]
set title "Write latency as the writer sees it: p50 (qemu-img bench: mean per 4 KiB request), log scale"
set logscale y
set ylabel "microseconds"
set yrange [0.01:*]
set format y "%g"
plot dir."/plot-latency.dat" \
       using 2:xtic(1) title "raw mapping: first touch" lc rgb "#9e9e9e", \
    '' using 3 title "pcow expansion (pool worker, default)" lc rgb "#0d47a1", \
    '' using 4 title "pcow expansion (inline refill)" lc rgb "#42a5f5", \
    '' using 5 title "pcow expansion (pool pre-filled)" lc rgb "#90caf9", \
    '' using 6 title "pcow copy-on-write: first write" lc rgb "#2e7d32", \
    '' using 7 title "pcow copy-on-write after a read" lc rgb "#81c784", \
    '' using 8 title "pcow 4 KiB write, mapped page" lc rgb "#f9a825", \
    '' using 9 title "qcow2 allocating write" lc rgb "#c62828", \
    '' using 10 title "qcow2 overwrite" lc rgb "#ef9a9a", \
    '' using 11 title "qcow2 overlay copy-on-write" lc rgb "#6a1b9a", \
    '' using 12 title "bare userfaultfd handler: expansion" lc rgb "#37474f", \
    '' using 13 title "pcow, preallocated: first write" lc rgb "#00838f"

# 2. Barrier vs pending pages.
set title "Barrier (p50) by pending private pages, vs fdatasync of a raw file after writing the same pages, log scale"
set ylabel "milliseconds"
set yrange [0.0001:*]
set xlabel "pending private pages (1 GiB region over a raw base; last two groups: 100 pages over a large sparse base)"
set xrange [*:*]
set xtics font ",9"
stats dir."/plot-barrier.dat" using 2 nooutput
ncol = STATS_columns
array bc[8] = ["#1565c0", "#2e7d32", "#6d4c41", "#6a1b9a", "#64b5f6", "#81c784", "#bcaaa4", "#ce93d8"]
plot for [i=2:ncol] dir."/plot-barrier.dat" using i:xtic(1) title columnheader(i) \
    lc rgb bc[(i - 2) % 8 + 1]
unset xlabel

# 3. Steady state ratios.
set xtics font ",11"
set xrange [-0.5:ncases - 0.5]
set title "Steady state after mapping: pcow / raw throughput (target >= 0.97; dashed line)"
unset logscale y
set ylabel "pcow / raw"
set yrange [0:1.8]
set format y "%.1f"
plot dir."/plot-steady.dat" \
       using 2:xtic(1) title "1 MiB sequential copies" lc rgb "#1565c0", \
    '' using 3 title "4 KiB random writes" lc rgb "#f9a825", \
    0.97 with lines dt 2 lw 2 lc rgb "#c62828" title "0.97"

unset multiplot
