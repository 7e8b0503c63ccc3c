{{/* Names ---------------------------------------------------------------- */}}

{{- define "sinkflex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name prefix of every object (release-chart, or the release name when it contains the chart name). */}}
{{- define "sinkflex.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of a component's objects: (dict "root" $ "component" "env") */}}
{{- define "sinkflex.componentName" -}}
{{- printf "%s-%s" (include "sinkflex.fullname" .root) .component }}
{{- end }}

{{/* The ServiceAccount every pod runs as: serviceAccount.name, else <fullname> when the chart makes it, else "default". */}}
{{- define "sinkflex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sinkflex.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels ---------------------------------------------------------------- */}}

{{- define "sinkflex.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "sinkflex.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: sinkflex
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "sinkflex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sinkflex.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Images: (dict "root" $ "image" .Values.env.image) */}}
{{- define "sinkflex.image" -}}
{{- $tag := default .root.Chart.AppVersion .image.tag }}
{{- if .root.Values.image.registry }}
{{- printf "%s/%s:%s" (trimSuffix "/" .root.Values.image.registry) .image.repository $tag }}
{{- else }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}

{{/* Service addresses ("host:port") the components are wired with. */}}
{{- define "sinkflex.envAddress" -}}
{{- printf "%s:%v" (include "sinkflex.componentName" (dict "root" . "component" "env")) .Values.env.port }}
{{- end }}
{{- define "sinkflex.rewardAddress" -}}
{{- printf "%s:%v" (include "sinkflex.componentName" (dict "root" . "component" "reward")) .Values.reward.port }}
{{- end }}
{{- define "sinkflex.rolloutAddress" -}}
{{- printf "%s:%v" (include "sinkflex.componentName" (dict "root" . "component" "rollout")) .Values.rollout.port }}
{{- end }}
{{- define "sinkflex.learnerAddress" -}}
{{- printf "%s:%v" (include "sinkflex.componentName" (dict "root" . "component" "learner")) .Values.learner.port }}
{{- end }}
{{- define "sinkflex.learnerHeadless" -}}
{{- printf "%s-headless" (include "sinkflex.componentName" (dict "root" . "component" "learner")) }}
{{- end }}
{{- define "sinkflex.userSimBaseUrl" -}}
{{- if .Values.userSim.enabled }}
{{- printf "http://%s:%v/v1" (include "sinkflex.componentName" (dict "root" . "component" "user-sim")) .Values.userSim.port }}
{{- else }}
{{- required "userSim.externalBaseUrl is required when userSim.enabled=false" .Values.userSim.externalBaseUrl }}
{{- end }}
{{- end }}
{{- define "sinkflex.userSimModel" -}}
{{- if .Values.userSim.enabled }}
{{- printf "openai/%s" .Values.userSim.servedModelName }}
{{- else }}
{{- required "userSim.externalModel is required when userSim.enabled=false" .Values.userSim.externalModel }}
{{- end }}
{{- end }}

{{/* Secrets ------------------------------------------------------------- */}}

{{- define "sinkflex.redisSecretName" -}}
{{- default (include "sinkflex.componentName" (dict "root" . "component" "redis")) .Values.redis.auth.existingSecret }}
{{- end }}
{{- define "sinkflex.modelSecretName" -}}
{{- default (include "sinkflex.componentName" (dict "root" . "component" "model-endpoints")) .Values.modelEndpoints.existingSecret }}
{{- end }}

{{/* True when the chart's Redis runs with one ACL user per role (redis.acl.enabled). */}}
{{- define "sinkflex.redisAcl" -}}
{{- if and .Values.redis.enabled .Values.redis.acl.enabled }}true{{ end }}
{{- end }}

{{/* How a component reaches the buffer. Called with (dict "root" $ "role" "<producer|consumer|reader>").
With ACL users (sinkflex.buffer.acl): REDIS_USERNAME = the role, REDIS_PASSWORD_FILE = its password
mounted from the Secret (sinkflex.redisVolume), REDIS_URL without a password. Without (an external
Redis): REDIS_PASSWORD from the Secret and REDIS_URL (Kubernetes expands $(REDIS_PASSWORD)). */}}
{{- define "sinkflex.redisEnv" -}}
{{- $root := .root }}
{{- if include "sinkflex.redisAcl" $root }}
- name: REDIS_USERNAME
  value: {{ .role | quote }}
- name: REDIS_PASSWORD_FILE
  value: /etc/sinkflex/redis/password
- name: REDIS_URL
  value: {{ printf "redis://%s:%v/0" (include "sinkflex.componentName" (dict "root" $root "component" "redis")) $root.Values.redis.port | quote }}
{{- else }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "sinkflex.redisSecretName" $root }}
      key: {{ $root.Values.redis.auth.existingSecretKey }}
- name: REDIS_URL
{{- if $root.Values.redis.enabled }}
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%v/0" (include "sinkflex.componentName" (dict "root" $root "component" "redis")) $root.Values.redis.port | quote }}
{{- else }}
  value: {{ required "redis.externalUrl is required when redis.enabled=false" $root.Values.redis.externalUrl | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- define "sinkflex.redisVolume" -}}
{{- if include "sinkflex.redisAcl" .root }}
- name: redis-auth
  secret:
    secretName: {{ include "sinkflex.redisSecretName" .root }}
    defaultMode: 0440
    items:
      - {key: {{ printf "%s-password" .role }}, path: password}
{{- end }}
{{- end }}
{{- define "sinkflex.redisMount" -}}
{{- if include "sinkflex.redisAcl" .root }}
- {name: redis-auth, mountPath: /etc/sinkflex/redis, readOnly: true}
{{- end }}
{{- end }}

{{/* The ACL rules of each buffer role on `stream` (Redis >= 7), as sinkflex.buffer.acl.acl_rules
writes them (tests/test_deploy_security.py compares the two). */}}
{{- define "sinkflex.redisAclRules" -}}
{{- $s := .stream }}
{{- $common := "+ping +multi +exec +discard +hello +auth +client|setname +client|setinfo +client|id +select +info +time +exists +type +xlen +xinfo|groups +xinfo|stream +smembers +scard +sismember +smismember +zcard +zmscore +zscore +hget +hgetall +get" }}
{{- $scripts := "+evalsha +eval +script|load +script|exists" }}
{{- $base := printf "on ~%s ~%s:* resetchannels -@all %s" $s $s $common }}
{{- if eq .role "producer" }}{{ printf "%s %s +xadd +xtrim +sadd +set +hincrby +xgroup|create" $base $scripts }}
{{- else if eq .role "consumer" }}{{ printf "%s %s +xreadgroup +xautoclaim +xclaim +xpending +xrange +xack +xdel +srem +zadd +zremrangebyscore +zremrangebyrank +del +xgroup|create (+xadd ~%s:dead)" $base $scripts $s }}
{{- else }}{{ $base }}
{{- end }}
{{- end }}

{{/* The experiment's rollout.max_staleness as this release sets it: maxStaleness, else
configOverrides' rollout.max_staleness, else "" (the experiment file's, which the chart cannot
read). Both set: fail (one value, one place). */}}
{{- define "sinkflex.maxStaleness" -}}
{{- $o := dig "rollout" "max_staleness" "" .Values.configOverrides -}}
{{- if not (kindIs "invalid" .Values.maxStaleness) -}}
{{- if not (kindIs "string" $o) -}}
{{- fail "maxStaleness and configOverrides.rollout.max_staleness both set rollout.max_staleness: set maxStaleness only" -}}
{{- end -}}
{{- int .Values.maxStaleness -}}
{{- else if not (kindIs "string" $o) -}}
{{- int $o -}}
{{- end -}}
{{- end -}}

{{/* The experiment's task.tasks_per_step as this release sets it (as sinkflex.maxStaleness). */}}
{{- define "sinkflex.tasksPerStep" -}}
{{- $o := dig "task" "tasks_per_step" "" .Values.configOverrides -}}
{{- if not (kindIs "invalid" .Values.tasksPerStep) -}}
{{- if not (kindIs "string" $o) -}}
{{- fail "tasksPerStep and configOverrides.task.tasks_per_step both set task.tasks_per_step: set tasksPerStep only" -}}
{{- end -}}
{{- int .Values.tasksPerStep -}}
{{- else if not (kindIs "string" $o) -}}
{{- int $o -}}
{{- end -}}
{{- end -}}

{{/* sinkflex_rl/config.py's refusals, at render time instead of at the pods' start: configOverrides
may not write a field the experiment derives (sinkflex_rl.config.DERIVED: learner_service.max_staleness,
learner_service.batch.groups_per_step, rollout_service.weight_updates; an old section name), nor
learner_service.grpo.old_logprobs "recompute" with asynchronous rollouts. */}}
{{- define "sinkflex.checkExperiment" -}}
{{- $co := .Values.configOverrides -}}
{{- if hasKey $co "learner" -}}
{{- fail "configOverrides: the section 'learner' is now 'learner_service': rename it" -}}
{{- end -}}
{{- range $path := list (list "learner_service" "max_staleness" "rollout.max_staleness (maxStaleness)") (list "learner_service" "batch.groups_per_step" "task.tasks_per_step (tasksPerStep)") (list "rollout_service" "weight_updates" "rollout.max_staleness (maxStaleness)") -}}
{{- $node := dig (index $path 0) dict $co -}}
{{- $keys := splitList "." (index $path 1) -}}
{{- range $k := initial $keys -}}{{- $node = dig $k dict $node -}}{{- end -}}
{{- if and (kindIs "map" $node) (hasKey $node (last $keys)) -}}
{{- fail (printf "configOverrides.%s.%s is derived from %s: set it there, not in the service section" (index $path 0) (index $path 1) (index $path 2)) -}}
{{- end -}}
{{- end -}}
{{- $k := include "sinkflex.maxStaleness" . -}}
{{- if and (ne $k "") (ne $k "0") (eq (toString (dig "learner_service" "grpo" "old_logprobs" "" $co)) "recompute") -}}
{{- fail "configOverrides.learner_service.grpo.old_logprobs \"recompute\" takes π_old from the learner's current weights, which ignores that asynchronous rollouts (maxStaleness >= 1) were sampled by an older policy: use \"engine\"" -}}
{{- end -}}
{{- end -}}

{{/* The KEDA redis-streams scalers' lagCount: keda.lagCount, else tasksPerStep × (maxStaleness + 1),
the most the training loop keeps undelivered in the trajectory stream by design. */}}
{{- define "sinkflex.kedaLagCount" -}}
{{- if not (kindIs "invalid" .Values.keda.lagCount) -}}
{{- int .Values.keda.lagCount -}}
{{- else -}}
{{- $k := include "sinkflex.maxStaleness" . -}}
{{- $n := include "sinkflex.tasksPerStep" . -}}
{{- if or (eq $k "") (eq $n "") -}}
{{- fail "keda.lagCount null means tasksPerStep × (maxStaleness + 1), the lag the training loop holds by design: set maxStaleness and tasksPerStep (the experiment's values), or keda.lagCount" -}}
{{- end -}}
{{- mul (atoi $n) (add (atoi $k) 1) -}}
{{- end -}}
{{- end -}}

{{/* The experiment every SinkFlex container derives its config from (docker/sinkflex_service.py),
and the addresses of the services of this release. */}}
{{- define "sinkflex.experimentEnv" -}}
{{- include "sinkflex.checkExperiment" . -}}
- name: SINKFLEX_CONFIG
  value: {{ .Values.trainingConfig | quote }}
- name: SINKFLEX_CONFIG_OVERRIDES
  value: {{ if .Values.configOverrides }}{{ toJson .Values.configOverrides | quote }}{{ else }}""{{ end }}
- name: SINKFLEX_MAX_STALENESS
  value: {{ include "sinkflex.maxStaleness" . | quote }}
- name: SINKFLEX_TASKS_PER_STEP
  value: {{ include "sinkflex.tasksPerStep" . | quote }}
- name: SINKFLEX_RUN_DIR
  value: /data/run
- name: SINKFLEX_POLICY
  value: {{ .Values.policyModel | quote }}
- name: SINKFLEX_ENV_ADDRESS
  value: {{ include "sinkflex.envAddress" . | quote }}
- name: SINKFLEX_REWARD_ADDRESS
  value: {{ include "sinkflex.rewardAddress" . | quote }}
- name: SINKFLEX_ROLLOUT_ADDRESS
  value: {{ include "sinkflex.rolloutAddress" . | quote }}
- name: SINKFLEX_LEARNER_ADDRESS
  value: {{ include "sinkflex.learnerAddress" . | quote }}
- name: SINKFLEX_USER_BASE_URL
  value: {{ include "sinkflex.userSimBaseUrl" . | quote }}
- name: SINKFLEX_USER_MODEL
  value: {{ include "sinkflex.userSimModel" . | quote }}
{{- end }}

{{/* Common container environment. */}}
{{- define "sinkflex.commonEnv" -}}
- name: LITELLM_LOCAL_MODEL_COST_MAP
  value: "True"
- name: PYTHONUNBUFFERED
  value: "1"
- name: POD_NAME
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
{{- end }}

{{/* HF_TOKEN from the model-endpoints Secret, HF cache on the shared volume. */}}
{{- define "sinkflex.hfEnv" -}}
- name: HF_HOME
  value: /models/hf
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sinkflex.modelSecretName" . }}
      key: hf-token
      optional: true
{{- end }}

{{/* Scheduling -------------------------------------------------------- */}}

{{/* GPU scheduling: gpuNodes defaults merged with the component's own: (dict "root" $ "c" .Values.rollout) */}}
{{- define "sinkflex.gpuScheduling" -}}
{{- $nodeSelector := merge (deepCopy (.c.nodeSelector | default dict)) (deepCopy .root.Values.gpuNodes.nodeSelector) }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := concat (.root.Values.gpuNodes.tolerations | default list) (.c.tolerations | default list) }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "sinkflex.cpuScheduling" -}}
{{- with .c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Probes on grpc.health.v1: (dict "root" $ "port" 50051 "service" "sinkflex.api.env.v1.EnvService" "startup" 300).
Kubernetes' native gRPC probes speak plaintext only: with tls.enabled the probes run the image's
`python -m sinkflex.healthcheck` on 127.0.0.1 instead (TLS from the SINKFLEX_TLS_* variables;
the certificate must name 127.0.0.1). */}}
{{- define "sinkflex.grpcProbes" -}}
{{- $p := .root.Values.probes }}
{{- $tls := .root.Values.tls.enabled }}
{{- $address := printf "127.0.0.1:%v" .port }}
startupProbe:
  {{- if $tls }}
  exec:
    command: ["python", "-m", "sinkflex.healthcheck", {{ $address | quote }}, "--service", {{ .service | quote }}, "--timeout", {{ $p.timeoutSeconds | quote }}]
  {{- else }}
  grpc:
    port: {{ .port }}
    service: {{ .service | quote }}
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ max 1 (div .startup $p.periodSeconds) }}
readinessProbe:
  {{- if $tls }}
  exec:
    command: ["python", "-m", "sinkflex.healthcheck", {{ $address | quote }}, "--service", {{ .service | quote }}, "--timeout", {{ $p.timeoutSeconds | quote }}]
  {{- else }}
  grpc:
    port: {{ .port }}
    service: {{ .service | quote }}
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
livenessProbe:
  {{- if $tls }}
  exec:
    command: ["python", "-m", "sinkflex.healthcheck", {{ $address | quote }}, "--timeout", {{ $p.timeoutSeconds | quote }}]
  {{- else }}
  grpc:
    port: {{ .port }}
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
{{- end }}

{{/* Volumes ------------------------------------------------------------- */}}

{{- define "sinkflex.sharedVolume" -}}
- name: shared
{{- if .Values.sharedStorage.enabled }}
  persistentVolumeClaim:
    claimName: {{ default (include "sinkflex.componentName" (dict "root" . "component" "shared")) .Values.sharedStorage.existingClaim }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "sinkflex.sharedMounts" -}}
- {name: shared, mountPath: /data, subPath: data}
- {name: shared, mountPath: /models, subPath: models}
{{- end }}

{{/* /dev/shm in memory (NCCL, vLLM workers): (dict "size" "16Gi") */}}
{{- define "sinkflex.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .size }}
{{- end }}

{{/* Security ------------------------------------------------------------ */}}

{{/* A container's securityContext: .Values.securityContext, with readOnlyRootFilesystem when
the container can run so and .Values.readOnlyRootFilesystem: (dict "root" $ "readOnly" true) */}}
{{- define "sinkflex.securityContext" -}}
{{- $sc := deepCopy (.root.Values.securityContext | default dict) }}
{{- if and .readOnly .root.Values.readOnlyRootFilesystem }}
{{- $_ := set $sc "readOnlyRootFilesystem" true }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/* The writable paths of a read-only root filesystem (/tmp: derived configs, tempfiles,
torchrun; $HOME: library caches), as emptyDirs. */}}
{{- define "sinkflex.writableVolumes" -}}
{{- if .Values.readOnlyRootFilesystem }}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
{{- end }}
{{- end }}
{{- define "sinkflex.writableMounts" -}}
{{- if .Values.readOnlyRootFilesystem }}
- {name: tmp, mountPath: /tmp}
- {name: home, mountPath: /home/sinkflex}
{{- end }}
{{- end }}

{{/* gRPC TLS (sinkflex.tls), one identity per component (sinkflex.authz: the certificate's common name is
the identity the servers' allow-lists check). Called with (dict "root" $ "identity" "<env|reward|rollout|
learner|driver>"). The certificate comes from tls.secrets.<identity> (a Secret with ca.crt, tls.crt,
tls.key: a cert-manager Certificate's), else from tls.existingSecret, of which only ca.crt,
<identity>.crt and <identity>.key are mounted (what scripts/tls_dev_certs.py writes): a pod never
holds another service's key. */}}
{{- define "sinkflex.tlsFiles" -}}
{{- $own := index (.root.Values.tls.secrets | default dict) .identity }}
{{- if $own }}{{ dict "secret" $own "crt" "tls.crt" "key" "tls.key" | toJson }}
{{- else }}{{ dict "secret" (required "tls.existingSecret (or tls.secrets.<identity>) is required when tls.enabled=true" .root.Values.tls.existingSecret) "crt" (printf "%s.crt" .identity) "key" (printf "%s.key" .identity) | toJson }}
{{- end }}
{{- end }}
{{- define "sinkflex.tlsEnv" -}}
{{- if .root.Values.tls.enabled }}
{{- $f := include "sinkflex.tlsFiles" . | fromJson }}
- name: SINKFLEX_TLS_CA_FILE
  value: {{ printf "%s/ca.crt" .root.Values.tls.mountPath | quote }}
- name: SINKFLEX_TLS_CERT_FILE
  value: {{ printf "%s/%s" .root.Values.tls.mountPath $f.crt | quote }}
- name: SINKFLEX_TLS_KEY_FILE
  value: {{ printf "%s/%s" .root.Values.tls.mountPath $f.key | quote }}
- name: SINKFLEX_TLS_CLIENT_AUTH
  value: {{ ternary "1" "0" .root.Values.tls.requireClientAuth | quote }}
{{- end }}
{{- end }}
{{- define "sinkflex.tlsVolume" -}}
{{- if .root.Values.tls.enabled }}
{{- $f := include "sinkflex.tlsFiles" . | fromJson }}
- name: tls
  secret:
    secretName: {{ $f.secret | quote }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: {{ $f.crt }}, path: {{ $f.crt }}}
      - {key: {{ $f.key }}, path: {{ $f.key }}}
{{- end }}
{{- end }}
{{- define "sinkflex.tlsMount" -}}
{{- if .root.Values.tls.enabled }}
- {name: tls, mountPath: {{ .root.Values.tls.mountPath | quote }}, readOnly: true}
{{- end }}
{{- end }}

{{/* Run preparation ------------------------------------------------------ */}}

{{/* The `tasks` init container: docker-compose.yml's one-shot `tasks` job (`sinkflex-service tasks`,
same image, same settings) writes the experiment's generated task set (task.generate) into
/data/run/tasks, or exits 0 at once (no task.generate; the folder already there with the same
settings; other settings: it fails, naming them). (dict "root" $ "shared" <bool>): shared=true
writes to the shared volume (the learner's pod: warm-start and the driver read it there),
false to the pod's own `data` emptyDir (env, reward: sinkflex.tasksVolume). */}}
{{- define "sinkflex.tasksInitContainer" -}}
{{- $root := .root }}
- name: tasks
  image: {{ include "sinkflex.image" (dict "root" $root "image" $root.Values.tasks.image) | quote }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["sinkflex-service", "tasks"]
  env:
    {{- include "sinkflex.commonEnv" $root | nindent 4 }}
    {{- include "sinkflex.experimentEnv" $root | nindent 4 }}
  resources:
    {{- toYaml $root.Values.tasks.resources | nindent 4 }}
  securityContext:
    {{- include "sinkflex.securityContext" (dict "root" $root "readOnly" true) | nindent 4 }}
  volumeMounts:
    {{- if .shared }}
    - {name: shared, mountPath: /data, subPath: data}
    {{- else }}
    - {name: data, mountPath: /data}
    {{- end }}
    {{- include "sinkflex.writableMounts" $root | nindent 4 }}
{{- end }}

{{/* env's and reward's own /data (tasks.enabled): an emptyDir the `tasks` init container fills
and the service reads read-only. Not the shared volume: see templates/env.yaml. */}}
{{- define "sinkflex.tasksVolume" -}}
{{- if .Values.tasks.enabled }}
- name: data
  emptyDir: {}
{{- end }}
{{- end }}
{{- define "sinkflex.tasksMount" -}}
{{- if .Values.tasks.enabled }}
- {name: data, mountPath: /data, readOnly: true}
{{- end }}
{{- end }}
