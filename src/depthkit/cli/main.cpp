// depthkit: train, compare and measure residual pathways that retrieve across depth.
#include <malloc.h>

#include "depthkit/cli/app.h"

int main(int argc, char** argv) {
  // Tensors of a training step are freed and allocated again at every step. glibc serves large
  // blocks with fresh mmap pages, so every step would fault in and zero them again (measured:
  // more system than user time in `bench --ops`). Keep freed memory in the heap for reuse, all of
  // it: with a threshold (1 GiB until 2026-12-07) the heap's top was given back whenever that much
  // was free, and the next step faulted it in again (in `bench --ops 0.1b` after each reference
  // composition of MSAR's read, which frees gigabytes: msar_read 160 ms cold, 103–119 warm).
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, -1);  // -1: never trim (mallopt(3))
  return depthkit::cli::run(argc, argv);
}
