"""The `vllm serve` flag table, as data: every flag of vLLM 0.33.0's `serve` (plus a few that
older releases had), its kind, and what `musespark serve` does with it. vllm_flags.py registers
and checks them; tests/server/test_vllm_flags_table.py holds every row to what the flag does.

Dispositions (one row per flag: its option strings, its kind, what we do):
* `ours`: serve_cli.py (or EngineArgs) handles it (same name, same meaning).
* `ignored: REASON`: accepted; one warning naming the flag and REASON when it is given.
* `refused: REASON`: start-up fails with REASON (for `bool` flags: only when turned on).
* `checked: RULE`: some values are fine, others ignored or refused (vllm_flags.py `CHECKS`).

Kinds (how many values the flag takes): `flag` (none), `bool` (none; vLLM also accepts
`--no-X` for each `--X` and `--disable-Y` for `--enable-Y` and back), `value` (one),
`optional` (zero or one), `list` (one or more), `append` (one, repeatable).
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM 0.33.0 `vllm serve` (from its parser: FrontendArgs + AsyncEngineArgs + serve's own),
# then a few flags of older releases that copied command lines still carry.
TABLE = """
--headless                                            flag     ignored: multi-process/multi-node serving is not implemented (one process here)
--api-server-count,-asc                               value    ignored: multi-process/multi-node serving is not implemented (one process here)
--config                                              value    refused: YAML config files are not read; pass the flags on the command line
--grpc                                                flag     refused: the gRPC server is not implemented
--lora-modules                                        list     refused: LoRA adapters are not implemented
--chat-template                                       value    ours
--chat-template-content-format                        value    ignored: frontend option not implemented
--trust-request-chat-template                         bool     ignored: frontend option not implemented
--trust-request-mm-kwargs                             bool     ignored: multimodal setting (Muse Spark is text-only)
--default-chat-template-kwargs                        value    ours
--reasoning-effort-map                                value    ours
--response-role                                       value    ignored: frontend option not implemented
--return-tokens-as-token-ids                          bool     ours
--enable-auto-tool-choice                             bool     ours
--exclude-tools-when-tool-choice-none                 bool     ignored: frontend option not implemented
--tool-call-parser                                    value    ours
--tool-parser-plugin                                  value    ignored: frontend option not implemented
--tool-strict-level                                   value    ignored: frontend option not implemented
--tool-server                                         value    ignored: frontend option not implemented
--max-log-len                                         value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--enable-prompt-tokens-details                        bool     ours
--enable-per-request-metrics                          bool     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--enable-server-load-tracking                         bool     ours
--enable-force-include-usage                          bool     ours
--sse-keep-alive-interval                             value    ignored: frontend option not implemented
--enable-tokenizer-info-endpoint                      bool     ours
--enable-log-outputs                                  bool     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--enable-log-deltas                                   bool     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--cohere-is-reasoning-model                           bool     ignored: frontend option not implemented
--cohere-format                                       value    ignored: frontend option not implemented
--anthropic-disabled-thinking-effort                  value    ignored: frontend option not implemented
--log-error-stack                                     bool     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--tokens-only                                         bool     refused: the server always tokenizes and detokenizes
--enable-scale-out                                    bool     ignored: the render and token-in/token-out endpoints (/v1/*/render, /inference/v1/generate) are always on
--fingerprint-mode                                    value    ignored: frontend option not implemented
--fingerprint-value                                   value    ignored: frontend option not implemented
--host                                                value    ours
--port                                                value    ours
--grpc-port                                           value    refused: the gRPC server is not implemented
--data-parallel-supervisor-port                       value    ignored: multi-process/multi-node serving is not implemented (one process here)
--dp-supervisor-probe-interval-s                      value    ignored: multi-process/multi-node serving is not implemented (one process here)
--dp-supervisor-probe-timeout-s                       value    ignored: multi-process/multi-node serving is not implemented (one process here)
--dp-supervisor-probe-failure-threshold               value    ignored: multi-process/multi-node serving is not implemented (one process here)
--uds                                                 value    ours
--uvicorn-log-level                                   value    ours
--disable-uvicorn-access-log                          bool     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--disable-access-log-for-endpoints                    value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--allow-credentials                                   bool     ignored: frontend option not implemented
--allowed-origins                                     value    ours
--allowed-methods                                     value    ignored: frontend option not implemented
--allowed-headers                                     value    ignored: frontend option not implemented
--api-key                                             list     ours
--ssl-keyfile                                         value    ours
--ssl-certfile                                        value    ours
--ssl-ca-certs                                        value    refused: client-certificate (mTLS) authentication is not implemented
--enable-ssl-refresh                                  bool     ignored: TLS settings beyond --ssl-keyfile and --ssl-certfile are not implemented
--ssl-cert-reqs                                       value    refused: client-certificate (mTLS) authentication is not implemented
--ssl-ciphers                                         value    ignored: TLS settings beyond --ssl-keyfile and --ssl-certfile are not implemented
--root-path                                           value    ours
--middleware                                          append   refused: custom ASGI middleware is not loaded (it may be an access control)
--enable-request-id-headers                           bool     ignored: frontend option not implemented
--disable-fastapi-docs                                bool     ours
--h11-max-incomplete-event-size                       value    ignored: frontend option not implemented
--h11-max-header-count                                value    ignored: frontend option not implemented
--enable-offline-docs                                 bool     ignored: frontend option not implemented
--enable-flash-late-interaction                       bool     ignored: frontend option not implemented
--model                                               value    ours
--runner                                              value    ignored: frontend option not implemented
--convert                                             value    ignored: frontend option not implemented
--tokenizer                                           value    ours
--tokenizer-mode                                      value    ignored: frontend option not implemented
--trust-remote-code                                   bool     ours
--dtype                                               value    ours
--seed                                                value    ours
--hf-config-path                                      value    ignored: weights are always loaded from MODEL's safetensors
--allowed-local-media-path                            value    ignored: multimodal setting (Muse Spark is text-only)
--allowed-media-domains                               list     ignored: multimodal setting (Muse Spark is text-only)
--revision                                            value    ignored: weights are always loaded from MODEL's safetensors
--code-revision                                       value    ignored: weights are always loaded from MODEL's safetensors
--tokenizer-revision                                  value    ignored: weights are always loaded from MODEL's safetensors
--max-model-len                                       value    ours
--quantization,-q                                     value    checked: modelopt_fp4 and modelopt accepted (an NVFP4 checkpoint's own quantization config is read); others ignored
--quantization-config                                 value    ignored: weights are always loaded from MODEL's safetensors
--allow-deprecated-quantization                       bool     ignored: weights are always loaded from MODEL's safetensors
--enforce-eager                                       bool     ignored: GPU-only setting (this engine runs on CPU)
--enable-return-routed-experts                        bool     ignored: frontend option not implemented
--return-sampling-mask                                bool     ignored: frontend option not implemented
--max-logprobs                                        value    ours
--logprobs-mode                                       value    ignored: frontend option not implemented
--use-fp64-gumbel                                     bool     ignored: GPU-only setting (this engine runs on CPU)
--enable-trace-replay                                 bool     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--disable-sliding-window                              bool     ignored: frontend option not implemented
--disable-cascade-attn                                bool     ignored: GPU-only setting (this engine runs on CPU)
--skip-tokenizer-init                                 bool     ours
--enable-prompt-embeds                                bool     ignored: frontend option not implemented
--served-model-name                                   list     ours
--config-format                                       value    ignored: weights are always loaded from MODEL's safetensors
--hf-token                                            optional ignored: weights are always loaded from MODEL's safetensors
--hf-overrides                                        value    ignored: weights are always loaded from MODEL's safetensors
--model-class-overrides                               value    ignored: weights are always loaded from MODEL's safetensors
--pooler-config                                       value    ignored: frontend option not implemented
--generation-config                                   value    ours
--override-generation-config                          value    ours: JSON of generation_config.json keys laid over the sampling defaults
--enable-sleep-mode                                   bool     ignored: GPU-only setting (this engine runs on CPU)
--sleep-mode-backend                                  value    ignored: GPU-only setting (this engine runs on CPU)
--sleep-mode-offload-cudagraph                        bool     ignored: GPU-only setting (this engine runs on CPU)
--sleep-preserve-parameter-names                      list     ignored: GPU-only setting (this engine runs on CPU)
--enable-cumem-allocator                              bool     ignored: GPU-only setting (this engine runs on CPU)
--enable-nccl-comm-suspend                            bool     ignored: GPU-only setting (this engine runs on CPU)
--model-impl                                          value    ignored: weights are always loaded from MODEL's safetensors
--logits-processors                                   list     ignored: frontend option not implemented
--io-processor-plugin                                 value    ignored: frontend option not implemented
--renderer-num-workers                                value    ignored: engine-internal scheduler tuning with no equivalent here
--load-format                                         value    ignored: weights are always loaded from MODEL's safetensors
--download-dir                                        value    ignored: weights are always loaded from MODEL's safetensors
--safetensors-load-strategy                           value    ignored: weights are always loaded from MODEL's safetensors
--safetensors-prefetch-num-threads                    value    ignored: weights are always loaded from MODEL's safetensors
--safetensors-prefetch-block-size                     value    ignored: weights are always loaded from MODEL's safetensors
--model-loader-extra-config                           value    ignored: weights are always loaded from MODEL's safetensors
--ignore-patterns                                     list     ignored: weights are always loaded from MODEL's safetensors
--use-tqdm-on-load                                    bool     ignored: weights are always loaded from MODEL's safetensors
--pt-load-map-location                                value    ignored: weights are always loaded from MODEL's safetensors
--attention-backend                                   value    ignored: GPU-only setting (this engine runs on CPU)
--mamba-backend                                       value    ignored: GPU-only setting (this engine runs on CPU)
--mamba-ssu-algorithm                                 value    ignored: GPU-only setting (this engine runs on CPU)
--enable-mamba-cache-stochastic-rounding              bool     ignored: model-architecture setting that does not apply to Muse Spark
--mamba-cache-philox-rounds                           value    ignored: model-architecture setting that does not apply to Muse Spark
--reasoning-parser                                    value    ours
--reasoning-parser-plugin                             value    ignored: frontend option not implemented
--distributed-executor-backend                        value    checked: mp (spawned workers, the default) and external_launcher (torchrun) accepted; others refused
--pipeline-parallel-size,-pp                          value    ours
--master-addr                                         value    ignored: multi-process/multi-node serving is not implemented (one process here)
--master-port                                         value    ignored: multi-process/multi-node serving is not implemented (one process here)
--nnodes,-n                                           value    ignored: multi-process/multi-node serving is not implemented (one process here)
--node-rank,-r                                        value    ignored: multi-process/multi-node serving is not implemented (one process here)
--distributed-timeout-seconds                         value    ignored: multi-process/multi-node serving is not implemented (one process here)
--cpu-distributed-timeout-seconds                     value    ignored: multi-process/multi-node serving is not implemented (one process here)
--numa-bind                                           bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--numa-bind-nodes                                     list     ignored: multi-process/multi-node serving is not implemented (one process here)
--numa-bind-cpus                                      list     ignored: multi-process/multi-node serving is not implemented (one process here)
--device-ids                                          value    ignored: multi-process/multi-node serving is not implemented (one process here)
--tensor-parallel-size,-tp                            value    ours
--decode-context-parallel-size,-dcp                   value    checked: 1 accepted; > 1 refused (context parallelism is not implemented)
--dcp-comm-backend                                    value    ignored: multi-process/multi-node serving is not implemented (one process here)
--dcp-q-replicate                                     bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--dcp-kv-cache-interleave-size                        value    ignored: multi-process/multi-node serving is not implemented (one process here)
--cp-kv-cache-interleave-size                         value    ignored: multi-process/multi-node serving is not implemented (one process here)
--prefill-context-parallel-size,-pcp                  value    checked: 1 accepted; > 1 refused (context parallelism is not implemented)
--data-parallel-size,-dp                              value    checked: 1 accepted; > 1 refused (data parallelism is not implemented; -tp, -pp and -ep are)
--data-parallel-rank,-dpn                             value    ignored: multi-process/multi-node serving is not implemented (one process here)
--data-parallel-start-rank,-dpr                       value    ignored: multi-process/multi-node serving is not implemented (one process here)
--data-parallel-size-local,-dpl                       value    ignored: multi-process/multi-node serving is not implemented (one process here)
--data-parallel-address,-dpa                          value    ignored: multi-process/multi-node serving is not implemented (one process here)
--data-parallel-rpc-port,-dpp                         value    ignored: multi-process/multi-node serving is not implemented (one process here)
--data-parallel-backend,-dpb                          value    ignored: multi-process/multi-node serving is not implemented (one process here)
--data-parallel-hybrid-lb,-dph                        bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--data-parallel-external-lb,-dpe                      bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--data-parallel-multi-port-external-lb,-dpm           flag     ignored: multi-process/multi-node serving is not implemented (one process here)
--enable-hc-sp                                        bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--enable-expert-parallel,-ep                          bool     ours
--enable-batch-sharded-sampling                       bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--enable-ep-weight-filter                             bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--all2all-backend                                     value    ignored: multi-process/multi-node serving is not implemented (one process here)
--enable-dbo                                          bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--enable-shm-tensor-arena                             bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--ubatch-size                                         value    ignored: multi-process/multi-node serving is not implemented (one process here)
--enable-elastic-ep                                   bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--elastic-ep-max-dp-size                              value    ignored: multi-process/multi-node serving is not implemented (one process here)
--dbo-decode-token-threshold                          value    ignored: multi-process/multi-node serving is not implemented (one process here)
--dp-sync-interval                                    value    ignored: multi-process/multi-node serving is not implemented (one process here)
--dbo-prefill-token-threshold                         value    ignored: multi-process/multi-node serving is not implemented (one process here)
--disable-nccl-for-dp-synchronization                 bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--enable-eplb                                         bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--eplb-config                                         value    ignored: multi-process/multi-node serving is not implemented (one process here)
--expert-placement-strategy                           value    ignored: multi-process/multi-node serving is not implemented (one process here)
--max-parallel-loading-workers                        value    ignored: multi-process/multi-node serving is not implemented (one process here)
--ray-workers-use-nsight                              bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--disable-custom-all-reduce                           bool     ignored: GPU-only setting (this engine runs on CPU)
--worker-cls                                          value    ignored: multi-process/multi-node serving is not implemented (one process here)
--worker-extension-cls                                value    ignored: multi-process/multi-node serving is not implemented (one process here)
--enable-fault-tolerance                              bool     ignored: multi-process/multi-node serving is not implemented (one process here)
--fault-tolerance-config                              value    ignored: multi-process/multi-node serving is not implemented (one process here)
--block-size                                          value    ours
--gpu-memory-utilization,--device-memory-utilization  value    ignored: GPU-only setting (this engine runs on CPU)
--kv-cache-memory-bytes                               value    ours
--kv-cache-dtype                                      value    ours
--num-gpu-blocks-override                             value    ignored: GPU-only setting (this engine runs on CPU)
--enable-prefix-caching                               bool     ours
--prefix-caching-hash-algo                            value    ignored: engine-internal scheduler tuning with no equivalent here
--prefix-cache-retention-interval                     value    ignored: engine-internal scheduler tuning with no equivalent here
--kv-cache-dtype-skip-layers                          list     ignored: model-architecture setting that does not apply to Muse Spark
--kv-sharing-fast-prefill                             bool     ignored: model-architecture setting that does not apply to Muse Spark
--swa-bounded-replay                                  bool     ignored: model-architecture setting that does not apply to Muse Spark
--mamba-cache-dtype                                   value    ignored: model-architecture setting that does not apply to Muse Spark
--mamba-ssm-cache-dtype                               value    ignored: model-architecture setting that does not apply to Muse Spark
--mamba-block-size                                    value    ignored: model-architecture setting that does not apply to Muse Spark
--prefix-match-unit                                   value    ignored: model-architecture setting that does not apply to Muse Spark
--mamba-cache-mode                                    value    ignored: model-architecture setting that does not apply to Muse Spark
--enable-mamba-shared-prefix-checkpoint               bool     ignored: model-architecture setting that does not apply to Muse Spark
--replayssm-buffer-len                                value    ignored: model-architecture setting that does not apply to Muse Spark
--use-replayssm                                       bool     ignored: model-architecture setting that does not apply to Muse Spark
--kv-offloading-size                                  value    ignored: GPU-only setting (this engine runs on CPU)
--kv-offloading-backend                               value    ignored: GPU-only setting (this engine runs on CPU)
--offload-backend                                     value    ignored: GPU-only setting (this engine runs on CPU)
--cpu-offload-gb                                      value    ignored: GPU-only setting (this engine runs on CPU)
--cpu-offload-params                                  list     ignored: GPU-only setting (this engine runs on CPU)
--offload-group-size                                  value    ignored: GPU-only setting (this engine runs on CPU)
--offload-num-in-group                                value    ignored: GPU-only setting (this engine runs on CPU)
--offload-prefetch-step                               value    ignored: GPU-only setting (this engine runs on CPU)
--offload-params                                      list     ignored: GPU-only setting (this engine runs on CPU)
--language-model-only                                 bool     ignored: multimodal setting (Muse Spark is text-only)
--limit-mm-per-prompt                                 value    ignored: multimodal setting (Muse Spark is text-only)
--enable-mm-embeds                                    bool     ignored: multimodal setting (Muse Spark is text-only)
--media-io-kwargs                                     value    ignored: multimodal setting (Muse Spark is text-only)
--mm-processor-kwargs                                 value    ignored: multimodal setting (Muse Spark is text-only)
--mm-processor-cache-gb                               value    ignored: multimodal setting (Muse Spark is text-only)
--mm-processor-cache-type                             value    ignored: multimodal setting (Muse Spark is text-only)
--mm-hasher-algorithm                                 value    ignored: multimodal setting (Muse Spark is text-only)
--mm-shm-cache-max-object-size-mb                     value    ignored: multimodal setting (Muse Spark is text-only)
--mm-encoder-only                                     bool     ignored: multimodal setting (Muse Spark is text-only)
--mm-encoder-tp-mode                                  value    ignored: multimodal setting (Muse Spark is text-only)
--mm-encoder-attn-backend                             value    ignored: multimodal setting (Muse Spark is text-only)
--mm-encoder-attn-dtype                               value    ignored: multimodal setting (Muse Spark is text-only)
--mm-encoder-fp8-scale-path                           value    ignored: multimodal setting (Muse Spark is text-only)
--mm-encoder-fp8-scale-save-path                      value    ignored: multimodal setting (Muse Spark is text-only)
--mm-encoder-fp8-scale-save-margin                    value    ignored: multimodal setting (Muse Spark is text-only)
--interleave-mm-strings                               bool     ignored: multimodal setting (Muse Spark is text-only)
--skip-mm-profiling                                   bool     ignored: frontend option not implemented
--video-pruning-rate                                  value    ignored: multimodal setting (Muse Spark is text-only)
--video-pruning-method                                value    ignored: multimodal setting (Muse Spark is text-only)
--mm-tensor-ipc                                       value    ignored: multimodal setting (Muse Spark is text-only)
--mm-processor-device                                 value    ignored: multimodal setting (Muse Spark is text-only)
--mm-ipc-gpu-memory-gb                                value    ignored: multimodal setting (Muse Spark is text-only)
--mm-device-do-normalize                              bool     ignored: multimodal setting (Muse Spark is text-only)
--enable-lora                                         bool     refused: LoRA adapters are not implemented
--max-loras                                           value    ignored: LoRA adapters are not implemented
--max-lora-rank                                       value    ignored: LoRA adapters are not implemented
--lora-dtype                                          value    ignored: LoRA adapters are not implemented
--enable-tower-connector-lora                         bool     ignored: LoRA adapters are not implemented
--max-cpu-loras                                       value    ignored: LoRA adapters are not implemented
--fully-sharded-loras                                 bool     ignored: LoRA adapters are not implemented
--lora-target-modules                                 list     ignored: LoRA adapters are not implemented
--default-mm-loras                                    value    ignored: LoRA adapters are not implemented
--specialize-active-lora                              bool     ignored: LoRA adapters are not implemented
--enable-mixed-moe-lora-format                        bool     ignored: LoRA adapters are not implemented
--enable-moe-shared-loras                             bool     ignored: LoRA adapters are not implemented
--max-lora-cls-labels                                 value    ignored: LoRA adapters are not implemented
--logging-config                                      value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--log-level                                           value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--log-config-file                                     value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--show-hidden-metrics-for-version                     value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--otlp-traces-endpoint                                value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--collect-detailed-traces                             list     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--per-request-spec-decode-metrics                     value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--kv-cache-metrics                                    bool     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--kv-cache-metrics-sample                             value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--custom-histogram-buckets                            value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--cudagraph-metrics                                   bool     ignored: GPU-only setting (this engine runs on CPU)
--enable-layerwise-nvtx-tracing                       bool     ignored: GPU-only setting (this engine runs on CPU)
--enable-mfu-metrics                                  bool     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--enable-logging-iteration-details                    bool     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--jit-monitor-mode                                    value    ignored: GPU-only setting (this engine runs on CPU)
--jit-monitor-verbose                                 bool     ignored: GPU-only setting (this engine runs on CPU)
--max-num-batched-tokens                              value    ours
--max-num-scheduled-tokens                            value    ignored: engine-internal scheduler tuning with no equivalent here
--max-num-seqs                                        value    ours
--max-num-active-seqs                                 value    ignored: engine-internal scheduler tuning with no equivalent here
--max-num-queued-reqs                                 value    ignored: engine-internal scheduler tuning with no equivalent here
--max-num-queued-tokens                               value    ignored: engine-internal scheduler tuning with no equivalent here
--long-prefill-token-threshold                        value    ignored: engine-internal scheduler tuning with no equivalent here
--long-prefill-token-threshold-adaptive               bool     ignored: engine-internal scheduler tuning with no equivalent here
--scheduling-policy                                   value    ignored: engine-internal scheduler tuning with no equivalent here
--enable-chunked-prefill                              bool     ignored: chunked prefill is always on here
--disable-chunked-mm-input                            bool     ignored: multimodal setting (Muse Spark is text-only)
--scheduler-cls                                       value    ignored: engine-internal scheduler tuning with no equivalent here
--scheduler-reserve-full-isl                          bool     ignored: engine-internal scheduler tuning with no equivalent here
--watermark                                           value    ignored: engine-internal scheduler tuning with no equivalent here
--prefill-schedule-interval                           value    ignored: engine-internal scheduler tuning with no equivalent here
--disable-hybrid-kv-cache-manager                     bool     ignored: model-architecture setting that does not apply to Muse Spark
--async-scheduling                                    bool     ignored: engine-internal scheduler tuning with no equivalent here
--stream-interval                                     value    ignored: engine-internal scheduler tuning with no equivalent here
--cudagraph-capture-sizes                             list     ignored: GPU-only setting (this engine runs on CPU)
--max-cudagraph-capture-size                          value    ignored: GPU-only setting (this engine runs on CPU)
--ir-op-priority                                      value    ignored: GPU-only setting (this engine runs on CPU)
--enable-flashinfer-autotune                          bool     ignored: GPU-only setting (this engine runs on CPU)
--monokernel                                          bool     ignored: GPU-only setting (this engine runs on CPU)
--moe-backend                                         value    ignored: GPU-only setting (this engine runs on CPU)
--linear-backend                                      value    ignored: GPU-only setting (this engine runs on CPU)
--sparse-indexer-topk-backend                         value    ignored: GPU-only setting (this engine runs on CPU)
--speculative-config,-sc                              value    ours
--spec-method                                         value    ignored: an older vLLM spelling; pass --speculative-config JSON (speculation stays off)
--spec-model                                          value    ignored: an older vLLM spelling; pass --speculative-config JSON (speculation stays off)
--spec-tokens                                         value    ignored: an older vLLM spelling; pass --speculative-config JSON (speculation stays off)
--watermark-config                                    value    ignored: frontend option not implemented
--diffusion-config,-dc                                value    ignored: frontend option not implemented
--kv-transfer-config                                  value    ignored: disaggregated serving / KV transfer is not implemented
--kv-events-config                                    value    ignored: disaggregated serving / KV transfer is not implemented
--ec-transfer-config                                  value    ignored: disaggregated serving / KV transfer is not implemented
--ec-manager-config                                   value    ignored: disaggregated serving / KV transfer is not implemented
--compilation-config,-cc                              value    ignored: GPU-only setting (this engine runs on CPU)
--attention-config,-ac                                value    ignored: GPU-only setting (this engine runs on CPU)
--engram-config                                       value    ignored: frontend option not implemented
--reasoning-config                                    value    ignored: frontend option not implemented
--kernel-config                                       value    ignored: GPU-only setting (this engine runs on CPU)
--additional-config                                   value    ignored: frontend option not implemented
--structured-outputs-config                           value    checked: backend auto/xgrammar accepted; anything else ignored
--aux-output-config                                   value    ignored: frontend option not implemented
--profiler-config                                     value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--watchdog-config                                     value    ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--optimization-level                                  value    ignored: GPU-only setting (this engine runs on CPU)
--performance-mode                                    value    ignored: GPU-only setting (this engine runs on CPU)
--weight-transfer-config                              value    ignored: disaggregated serving / KV transfer is not implemented
--disable-log-stats                                   flag     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--aggregate-engine-logging                            flag     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--fail-on-environ-validation                          bool     ignored: logging/metrics/tracing option not implemented (Prometheus metrics are at /metrics)
--shutdown-timeout                                    value    ours
--gdn-prefill-backend                                 value    ignored: GPU-only setting (this engine runs on CPU)
--kda-prefill-backend                                 value    ignored: GPU-only setting (this engine runs on CPU)
--kda-decode-backend                                  value    ignored: GPU-only setting (this engine runs on CPU)
--enable-log-requests                                 bool     ours
--swap-space                                          value    ignored: (older vLLM) engine-internal scheduler tuning with no equivalent here
--cuda-graph-sizes                                    list     ignored: (older vLLM) engine-internal scheduler tuning with no equivalent here
--max-seq-len-to-capture                              value    ignored: (older vLLM) engine-internal scheduler tuning with no equivalent here
--max-num-partial-prefills                            value    ignored: (older vLLM) engine-internal scheduler tuning with no equivalent here
"""

KINDS = ("flag", "bool", "value", "optional", "list", "append")
ACTIONS = ("ours", "ignored", "refused", "checked")


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]  # as vLLM declares them (first: the long name); see option_strings()
    kind: str
    disposition: str  # "ours" | "ignored: ..." | "refused: ..." | "checked: ..."

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def dest(self) -> str:
        """Where add_vllm_compat_args stores it: never a name our own flags use."""
        return "vllm_" + self.name.lstrip("-").replace("-", "_")

    @property
    def action(self) -> str:
        return self.disposition.split(":", 1)[0]

    @property
    def reason(self) -> str:
        return self.disposition.split(":", 1)[1].strip() if ":" in self.disposition else ""

    def option_strings(self) -> tuple[list[str], list[str]]:
        """(spellings that turn it on, spellings that turn it off); the second is empty
        unless kind is `bool`."""
        if self.kind != "bool":
            return list(self.names), []
        off = ["--no-" + n[2:] for n in self.names if n.startswith("--")]
        for n in self.names:
            for a, b in (("--enable-", "--disable-"), ("--disable-", "--enable-")):
                if n.startswith(a):
                    off.append(b + n[len(a) :])
        return list(self.names), off


def parse_table(text: str) -> tuple[VllmFlag, ...]:
    flags = []
    for line in text.strip().splitlines():
        names, kind, disposition = line.split(None, 2)
        if kind not in KINDS or disposition.split(":", 1)[0] not in ACTIONS:
            raise ValueError(f"vLLM flag table row {line!r}: kind must be one of {KINDS}, action one of {ACTIONS}")
        flags.append(VllmFlag(tuple(names.split(",")), kind, disposition))
    return tuple(flags)


VLLM_SERVE_FLAGS = parse_table(TABLE)
BY_NAME = {f.name: f for f in VLLM_SERVE_FLAGS}
