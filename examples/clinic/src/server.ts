/**
 * The clinic environment: a SinkFlex-RL env written in TypeScript, plugged in over gRPC.
 *
 * It implements `sinkflex.api.env.v1.EnvService` with @grpc/grpc-js and the code ts-proto
 * generates from protos/ (src/gen, by `buf generate`), and serves grpc.health.v1 and
 * server reflection. The domain and its checker are in domain.ts.
 *
 *   npm ci && npm run build && node dist/server.js --port 50062
 *   sinkflex-rl env check 127.0.0.1:50062
 *
 * Episodes (Gymnasium semantics): Reset's observation is the customer's request; each Step
 * runs the action's tool calls in order; a call to `done`, agent text holding ###STOP###,
 * or StepRequest.stop ends the episode (terminated, AGENT_STOP) and that step carries the
 * checker's reward; before it every step's reward is 0. The step budget (ResetRequest.max_steps,
 * default 30) ends it as truncated (MAX_STEPS) with reward 0.
 */

import { randomUUID } from "node:crypto";
import { existsSync } from "node:fs";
import * as path from "node:path";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import { ReflectionService } from "@grpc/reflection";
import { HealthImplementation, protoPath as healthProtoPath } from "grpc-health-check";

import { Message, Role, TerminationReason, ToolCall, ToolSpec } from "./gen/sinkflex/api/common/v1/common";
import {
  CloseRequest,
  CloseResponse,
  EnvServiceServer,
  EnvServiceService,
  ListEnvironmentsRequest,
  ListEnvironmentsResponse,
  ListTasksRequest,
  ListTasksResponse,
  ResetRequest,
  ResetResponse,
  StepRequest,
  StepResponse,
} from "./gen/sinkflex/api/env/v1/env";
import {
  callTool,
  Db,
  DONE_TOOL,
  lookup,
  shown,
  initialDb,
  POLICY,
  score,
  SPLITS,
  STOP_TOKEN,
  TASKS,
  ToolError,
  TOOLS,
  toolSchema,
} from "./domain";

export const ENV_NAME = "clinic";
/** The limit the Python services use on both sides (sinkflex.serving.DEFAULT_MAX_MESSAGE_BYTES). */
export const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;
const ENV_SERVICE = "sinkflex.api.env.v1.EnvService";

/** A call failed with a status code and a message saying what was wrong. */
class Status extends Error {
  constructor(
    readonly code: grpc.status,
    message: string,
  ) {
    super(message);
  }
}

const notFound = (what: string) => new Status(grpc.status.NOT_FOUND, what);

interface Session {
  taskId: string;
  db: Db;
  steps: number;
  maxSteps: number;
  done: boolean;
  lastUsed: number;
}

export interface Options {
  maxSessions: number;
  sessionTtlSeconds: number;
  defaultMaxSteps: number;
}

function toolMessage(call: ToolCall, content: string, error: boolean): Message {
  return Message.fromPartial({
    role: Role.ROLE_TOOL,
    content,
    toolCallId: call.id,
    error,
    requestor: Role.ROLE_ASSISTANT,
  });
}

/** The sessions and the five RPCs as plain methods; a refused request throws a Status. */
export class ClinicEnv {
  private readonly sessions = new Map<string, Session>();

  constructor(private readonly options: Options) {}

  listEnvironments(_req: ListEnvironmentsRequest): ListEnvironmentsResponse {
    return ListEnvironmentsResponse.fromPartial({
      environments: [
        {
          name: ENV_NAME,
          description: "A clinic's front desk: find, book and cancel doctors' appointments (TypeScript).",
          splits: Object.keys(SPLITS),
          numTasks: Object.keys(TASKS).length,
          supportsSolo: true,
        },
      ],
    });
  }

  listTasks(req: ListTasksRequest): ListTasksResponse {
    const ids = this.taskIds(req.env, req.split);
    return ListTasksResponse.fromPartial({ tasks: ids.map((id) => ({ taskId: id, description: TASKS[id].request })) });
  }

  reset(req: ResetRequest): ResetResponse {
    const ids = this.taskIds(req.env, req.split);
    let taskId = req.taskId;
    if (!taskId) {
      const n = BigInt(ids.length);
      taskId = ids[Number(((req.seed % n) + n) % n)]; // the seed picks the task of the split
    }
    if (lookup(TASKS, taskId) === undefined) throw notFound(`unknown task ${shown(taskId)} in env ${ENV_NAME}`);
    if (req.maxSteps < 0) {
      throw new Status(grpc.status.INVALID_ARGUMENT, `max_steps must be >= 0 (0: the server default), got ${req.maxSteps}`);
    }
    this.expire();
    if (this.sessions.size >= this.options.maxSessions) {
      throw new Status(grpc.status.RESOURCE_EXHAUSTED, `${this.options.maxSessions} sessions open: Close some first`);
    }
    const sessionId = randomUUID();
    this.sessions.set(sessionId, {
      taskId,
      db: initialDb(),
      steps: 0,
      maxSteps: req.maxSteps || this.options.defaultMaxSteps,
      done: false,
      lastUsed: Date.now(),
    });
    const tools = Object.entries(TOOLS).map(([name, t]) =>
      ToolSpec.fromPartial({ name, description: t.description, parametersJsonSchema: toolSchema(t) }),
    );
    return ResetResponse.fromPartial({
      sessionId,
      taskId,
      observation: [Message.fromPartial({ role: Role.ROLE_USER, content: TASKS[taskId].request })],
      tools,
      systemPrompt: POLICY,
      policy: POLICY,
      info: { env: ENV_NAME, task_id: taskId },
    });
  }

  step(req: StepRequest): StepResponse {
    const s = this.session(req.sessionId);
    if (s.done) throw new Status(grpc.status.FAILED_PRECONDITION, `session ${req.sessionId} has ended; Reset a new one`);
    const action = req.action ?? Message.fromPartial({});
    if (action.role !== Role.ROLE_UNSPECIFIED && action.role !== Role.ROLE_ASSISTANT) {
      throw new Status(grpc.status.INVALID_ARGUMENT, `action.role must be ROLE_ASSISTANT, got ${Role[action.role] ?? action.role}`);
    }
    if (req.stop && action.toolCalls.length > 0) {
      throw new Status(grpc.status.INVALID_ARGUMENT, "stop=True with tool calls: send the tool calls in one step, then stop");
    }
    s.steps += 1;
    const observation: Message[] = [];
    let stop = req.stop || (action.content ?? "").includes(STOP_TOKEN);
    for (const call of action.toolCalls) {
      if (stop) break; // calls after `done` are not run
      try {
        observation.push(toolMessage(call, callTool(s.db, call.name, call.argumentsJson), false));
        stop = call.name === DONE_TOOL;
      } catch (err) {
        if (!(err instanceof ToolError)) throw err;
        observation.push(toolMessage(call, `Error: ${err.message}`, true));
      }
    }
    if (stop) {
      s.done = true;
      const sc = score(s.taskId, s.db);
      return StepResponse.fromPartial({
        observation,
        reward: sc.reward,
        terminated: true,
        terminationReason: TerminationReason.TERMINATION_REASON_AGENT_STOP,
        info: {
          checker: "clinic changes: reward = expected changes made / expected, 0 on any other change",
          expected_changes: JSON.stringify(sc.expected),
          achieved_changes: JSON.stringify(sc.achieved),
          unexpected_changes: JSON.stringify(sc.unexpected),
          steps: String(s.steps),
        },
      });
    }
    if (action.toolCalls.length === 0) {
      observation.push(Message.fromPartial({ role: Role.ROLE_USER, content: `Please go ahead with the tools, then call ${DONE_TOOL}.` }));
    }
    if (s.steps >= s.maxSteps) {
      s.done = true;
      return StepResponse.fromPartial({
        observation,
        truncated: true,
        terminationReason: TerminationReason.TERMINATION_REASON_MAX_STEPS,
        info: { steps: String(s.steps), reason: `step budget of ${s.maxSteps} spent` },
      });
    }
    return StepResponse.fromPartial({ observation, info: { steps: String(s.steps) } });
  }

  close(req: CloseRequest): CloseResponse {
    this.session(req.sessionId);
    this.sessions.delete(req.sessionId);
    return CloseResponse.fromPartial({});
  }

  private taskIds(env: string, split: string): string[] {
    if (env !== ENV_NAME) throw notFound(`unknown env ${shown(env)}; this server serves ${JSON.stringify(ENV_NAME)}`);
    if (!split) return Object.keys(TASKS);
    const ids = lookup(SPLITS, split);
    if (!ids) throw notFound(`unknown split ${shown(split)}; splits: ${Object.keys(SPLITS).join(", ")}`);
    return ids;
  }

  private session(sessionId: string): Session {
    this.expire();
    const s = this.sessions.get(sessionId);
    if (!s) throw notFound(`unknown, closed or expired session ${shown(sessionId)}`);
    s.lastUsed = Date.now();
    return s;
  }

  /** Drops sessions idle longer than the TTL. */
  private expire(): void {
    const cutoff = Date.now() - this.options.sessionTtlSeconds * 1000;
    for (const [id, s] of this.sessions) if (s.lastUsed < cutoff) this.sessions.delete(id);
  }
}

/** A unary handler: a Status becomes its code, anything else INTERNAL (with what was thrown). */
function unary<Req, Res>(fn: (req: Req) => Res): grpc.handleUnaryCall<Req, Res> {
  return (call, callback) => {
    try {
      callback(null, fn(call.request));
    } catch (err) {
      const status = err instanceof Status ? err : new Status(grpc.status.INTERNAL, `${(err as Error).stack ?? err}`);
      callback({ code: status.code, details: status.message });
    }
  };
}

/** The EnvService implementation (generated interface) over a ClinicEnv. */
export function envService(env: ClinicEnv): EnvServiceServer {
  return {
    listEnvironments: unary((req: ListEnvironmentsRequest) => env.listEnvironments(req)),
    listTasks: unary((req: ListTasksRequest) => env.listTasks(req)),
    reset: unary((req: ResetRequest) => env.reset(req)),
    step: unary((req: StepRequest) => env.step(req)),
    close: unary((req: CloseRequest) => env.close(req)),
  };
}

function parseArgs(argv: string[]) {
  const out = { host: "127.0.0.1", port: 50062, maxSessions: 256, sessionTtl: 600, maxSteps: 30, protos: "" };
  const usage =
    "usage: node dist/server.js [--host H] [--port P] [--max-sessions N] [--session-ttl SECONDS] " +
    "[--max-steps N] [--protos DIR (for reflection; default: the repository's protos/)]";
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const value = argv[i + 1];
    const num = () => {
      const n = Number(value);
      if (!Number.isInteger(n) || n < 0) throw new Error(`${flag} needs a non-negative integer, got ${value}\n${usage}`);
      i++;
      return n;
    };
    if (flag === "--host" && value) (out.host = value), i++;
    else if (flag === "--port") out.port = num();
    else if (flag === "--max-sessions") out.maxSessions = num();
    else if (flag === "--session-ttl") out.sessionTtl = num();
    else if (flag === "--max-steps") out.maxSteps = num();
    else if (flag === "--protos" && value) (out.protos = value), i++;
    else if (flag === "-h" || flag === "--help") {
      console.log(usage);
      process.exit(0);
    } else throw new Error(`unknown argument ${flag}\n${usage}`);
  }
  return out;
}

/** Reflection over the contract's .proto files (grpcurl, grpcui); skipped when they are not found. */
function addReflection(server: grpc.Server, protosDir: string): boolean {
  const envProto = path.join(protosDir, "sinkflex/api/env/v1/env.proto");
  if (!existsSync(envProto)) return false;
  const pkg = protoLoader.loadSync([envProto, healthProtoPath], {
    includeDirs: [protosDir, path.dirname(healthProtoPath)],
  });
  new ReflectionService(pkg).addToServer(server);
  return true;
}

export function main(argv: string[]): void {
  const args = parseArgs(argv);
  const server = new grpc.Server({
    "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
  });
  const env = new ClinicEnv({ maxSessions: args.maxSessions, sessionTtlSeconds: args.sessionTtl, defaultMaxSteps: args.maxSteps });
  server.addService(EnvServiceService, envService(env));
  const health = new HealthImplementation({ "": "NOT_SERVING", [ENV_SERVICE]: "NOT_SERVING" });
  health.addToServer(server);
  const reflection = addReflection(server, args.protos || path.resolve(__dirname, "../../../protos"));
  server.bindAsync(`${args.host}:${args.port}`, grpc.ServerCredentials.createInsecure(), (err, port) => {
    if (err) {
      console.error(`clinic env: cannot bind ${args.host}:${args.port}: ${err.message}`);
      process.exit(1);
    }
    health.setStatus("", "SERVING");
    health.setStatus(ENV_SERVICE, "SERVING");
    console.log(`clinic env serving on ${args.host}:${port}${reflection ? "" : " (no reflection: protos/ not found)"}`);
  });
  let stopping = false;
  const stop = () => {
    if (stopping) return;
    stopping = true;
    health.setStatus("", "NOT_SERVING");
    health.setStatus(ENV_SERVICE, "NOT_SERVING");
    const force = setTimeout(() => server.forceShutdown(), 5000);
    server.tryShutdown(() => {
      clearTimeout(force);
      process.exit(0);
    });
  };
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
}

if (require.main === module) {
  try {
    main(process.argv.slice(2));
  } catch (err) {
    console.error((err as Error).message);
    process.exit(2);
  }
}
