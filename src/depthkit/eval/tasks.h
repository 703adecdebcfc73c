// Downstream evaluation (`depthkit eval --task`, docs/tasks.md), MSAR Appendix A's protocols:
// likelihood-based multiple choice and generation with answer scoring. Three parts:
//   task_file.h     reading task files (the JSONL schema, the HellaSwag/ARC mappings, dev files,
//                   few-shot draws)
//   task_scoring.h  scoring a task on a model (continuation log-likelihoods, greedy answers,
//                   accuracies with standard errors, the result's JSON and text)
//   task_types.h    the task-type table: what differs between multiple choice and generation
// This header includes all three.
#pragma once
#include "depthkit/eval/task_file.h"
#include "depthkit/eval/task_scoring.h"
#include "depthkit/eval/task_types.h"
