// depthkit: train, compare and measure residual pathways that retrieve across depth.
#include <malloc.h>

#include "depthkit/cli/app.h"

int main(int argc, char** argv) {
  // Tensors of a training step are freed and allocated again at every step. glibc serves large
  // blocks with fresh mmap pages, so every step would fault in and zero them again (measured:
  // more system than user time in `bench --ops`). Keep freed memory in the heap for reuse.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return depthkit::cli::run(argc, argv);
}
