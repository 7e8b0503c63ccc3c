/**
 * The clinic domain: a front desk booking doctors' appointments.
 *
 * Plain TypeScript, no gRPC: the database, the tools the agent calls, the tasks with
 * their train/test split, and the checker that scores an episode's final state.
 *
 * The checker compares what the episode changed with what the task's golden actions
 * change (booked and cancelled appointments, as (patient, slot) pairs): the reward is the
 * fraction of the expected changes made, and 0 when anything else changed. A task with
 * nothing to do (a forbidden request, no free slot) scores 1 when nothing changed.
 */

export interface Slot {
  doctorId: string;
  day: Day;
  time: string;
}

export interface Appointment {
  patientId: string;
  slotId: string;
}

export interface Db {
  doctors: Record<string, { name: string; specialty: string }>;
  slots: Record<string, Slot>;
  patients: Record<string, { name: string }>;
  appointments: Record<string, Appointment>;
  nextAppointment: number;
}

export const DAYS = ["Mon", "Tue", "Wed", "Thu", "Fri"] as const;
export type Day = (typeof DAYS)[number];

export function initialDb(): Db {
  return {
    doctors: {
      d1: { name: "Dr. Amara Okafor", specialty: "cardiology" },
      d2: { name: "Dr. Lena Lindqvist", specialty: "dermatology" },
      d3: { name: "Dr. Ravi Rao", specialty: "general practice" },
    },
    slots: {
      s1: { doctorId: "d1", day: "Mon", time: "09:00" },
      s2: { doctorId: "d1", day: "Mon", time: "11:00" },
      s3: { doctorId: "d1", day: "Wed", time: "10:00" },
      s4: { doctorId: "d2", day: "Tue", time: "09:30" },
      s5: { doctorId: "d2", day: "Thu", time: "15:00" },
      s6: { doctorId: "d2", day: "Fri", time: "10:00" },
      s7: { doctorId: "d3", day: "Tue", time: "10:00" },
      s8: { doctorId: "d3", day: "Tue", time: "14:00" },
      s9: { doctorId: "d3", day: "Thu", time: "09:00" },
      s10: { doctorId: "d3", day: "Fri", time: "16:00" },
    },
    patients: {
      p1: { name: "Mara Silva" },
      p2: { name: "Tom Becker" },
      p3: { name: "Yuki Tanaka" },
      p4: { name: "Omar Haddad" },
    },
    appointments: {
      a1: { patientId: "p2", slotId: "s4" },
      a2: { patientId: "p3", slotId: "s6" },
    },
    nextAppointment: 3,
  };
}

/** A tool's failure: answered as a tool message with `error` set; the episode goes on. */
export class ToolError extends Error {}

type Args = Record<string, string>;

/** `value` for an error message, cut to `max` characters (an error must stay bounded:
 * gRPC carries it in a header, and input may be megabytes). */
export function clip(value: string, max = 200): string {
  return value.length > max ? `${value.slice(0, max)}… (${value.length} chars)` : value;
}

/** `clip(value)` as a JSON string literal. */
export function shown(value: string, max = 200): string {
  return JSON.stringify(clip(value, max));
}

/** `table[key]` when `key` is the table's own entry, else undefined: keys come from the model
 * (untrusted), and names every object inherits ("toString", "__proto__", "constructor") are
 * not entries. */
export function lookup<T>(table: Record<string, T>, key: string): T | undefined {
  return Object.prototype.hasOwnProperty.call(table, key) ? table[key] : undefined;
}

function slotView(db: Db, slotId: string) {
  const s = db.slots[slotId];
  const d = db.doctors[s.doctorId];
  return { slot_id: slotId, doctor_id: s.doctorId, doctor: d.name, specialty: d.specialty, day: s.day, time: s.time };
}

function slotTaken(db: Db, slotId: string): boolean {
  return Object.values(db.appointments).some((a) => a.slotId === slotId);
}

function patient(db: Db, patientId: string) {
  const p = lookup(db.patients, patientId);
  if (!p) throw new ToolError(`patient ${clip(patientId)} not found`);
  return p;
}

const slotOrder = (db: Db) => (a: string, b: string) => {
  const x = db.slots[a];
  const y = db.slots[b];
  return DAYS.indexOf(x.day) - DAYS.indexOf(y.day) || x.time.localeCompare(y.time) || a.localeCompare(b);
};

function findSlots(db: Db, args: Args) {
  const { doctor_id, specialty, day } = args;
  if (day !== undefined && !(DAYS as readonly string[]).includes(day)) {
    throw new ToolError(`day must be one of ${DAYS.join(", ")}, got ${shown(day)}`);
  }
  return Object.keys(db.slots)
    .filter((id) => !slotTaken(db, id))
    .filter((id) => doctor_id === undefined || db.slots[id].doctorId === doctor_id)
    .filter((id) => specialty === undefined || db.doctors[db.slots[id].doctorId].specialty === specialty.toLowerCase())
    .filter((id) => day === undefined || db.slots[id].day === day)
    .sort(slotOrder(db))
    .map((id) => slotView(db, id));
}

function getPatient(db: Db, args: Args) {
  const p = patient(db, args.patient_id);
  const appointments = Object.entries(db.appointments)
    .filter(([, a]) => a.patientId === args.patient_id)
    .map(([id, a]) => ({ appointment_id: id, ...slotView(db, a.slotId) }));
  return { patient_id: args.patient_id, name: p.name, appointments };
}

function bookAppointment(db: Db, args: Args) {
  patient(db, args.patient_id);
  const slot = lookup(db.slots, args.slot_id);
  if (!slot) throw new ToolError(`slot ${clip(args.slot_id)} not found`);
  if (slotTaken(db, args.slot_id)) throw new ToolError(`slot ${clip(args.slot_id)} is already booked`);
  const sameDoctor = Object.entries(db.appointments).find(
    ([, a]) => a.patientId === args.patient_id && db.slots[a.slotId].doctorId === slot.doctorId,
  );
  if (sameDoctor) {
    throw new ToolError(`patient ${clip(args.patient_id)} already has appointment ${sameDoctor[0]} with ${db.doctors[slot.doctorId].name}`);
  }
  const id = `a${db.nextAppointment++}`;
  db.appointments[id] = { patientId: args.patient_id, slotId: args.slot_id };
  return { appointment_id: id, patient_id: args.patient_id, ...slotView(db, args.slot_id) };
}

function cancelAppointment(db: Db, args: Args) {
  patient(db, args.patient_id);
  const a = lookup(db.appointments, args.appointment_id);
  if (!a) throw new ToolError(`appointment ${clip(args.appointment_id)} not found`);
  if (a.patientId !== args.patient_id) {
    throw new ToolError(`appointment ${clip(args.appointment_id)} is not patient ${clip(args.patient_id)}'s`);
  }
  delete db.appointments[args.appointment_id];
  return { cancelled: args.appointment_id, patient_id: args.patient_id };
}

export interface Tool {
  description: string;
  /** JSON Schema of the arguments: string properties only. */
  properties: Record<string, string>;
  required: string[];
  run: (db: Db, args: Args) => unknown;
}

/** The name of the tool that ends the episode (as tau2's `done`). */
export const DONE_TOOL = "done";
/** Agent text holding this token ends the episode too (tau2's stop token). */
export const STOP_TOKEN = "###STOP###";

export const TOOLS: Record<string, Tool> = {
  find_slots: {
    description: "Free appointment slots, earliest first; every filter is optional.",
    properties: {
      doctor_id: "a doctor id, e.g. d1",
      specialty: "cardiology, dermatology or general practice",
      day: `one of ${DAYS.join(", ")}`,
    },
    required: [],
    run: findSlots,
  },
  get_patient: {
    description: "A patient's name and appointments.",
    properties: { patient_id: "the patient id, e.g. p1" },
    required: ["patient_id"],
    run: getPatient,
  },
  book_appointment: {
    description: "Book a free slot for a patient (at most one appointment per doctor and patient).",
    properties: { patient_id: "the patient id", slot_id: "a free slot id, e.g. s1" },
    required: ["patient_id", "slot_id"],
    run: bookAppointment,
  },
  cancel_appointment: {
    description: "Cancel one of the patient's own appointments.",
    properties: { patient_id: "the patient id", appointment_id: "the appointment id, e.g. a1" },
    required: ["patient_id", "appointment_id"],
    run: cancelAppointment,
  },
  [DONE_TOOL]: {
    description: "Call when the request is served (or cannot be): ends the conversation.",
    properties: {},
    required: [],
    run: () => ({ done: true }),
  },
};

export function toolSchema(tool: Tool): string {
  const properties = Object.fromEntries(
    Object.entries(tool.properties).map(([k, d]) => [k, { type: "string", description: d }]),
  );
  return JSON.stringify({ type: "object", properties, required: tool.required, additionalProperties: false });
}

/** Runs one tool call on `db`; returns its JSON result. Throws ToolError on bad input. */
export function callTool(db: Db, name: string, argumentsJson: string): string {
  const tool = lookup(TOOLS, name);
  if (!tool) throw new ToolError(`unknown tool ${shown(name)}; tools: ${Object.keys(TOOLS).join(", ")}`);
  let args: unknown;
  try {
    args = JSON.parse(argumentsJson || "{}");
  } catch (err) {
    throw new ToolError(`arguments are not valid JSON: ${(err as Error).message}`);
  }
  if (typeof args !== "object" || args === null || Array.isArray(args)) {
    throw new ToolError("arguments must be a JSON object");
  }
  const given = args as Record<string, unknown>;
  const has = (o: object, k: string) => Object.prototype.hasOwnProperty.call(o, k);
  const missing = tool.required.filter((k) => !has(given, k));
  const extra = Object.keys(given).filter((k) => !has(tool.properties, k));
  const notStrings = Object.keys(given).filter((k) => typeof given[k] !== "string");
  if (missing.length || extra.length || notStrings.length) {
    const list = (ks: string[]) => ks.slice(0, 10).map((k) => shown(k, 60)).join(", ") + (ks.length > 10 ? ", …" : "");
    throw new ToolError(
      `bad arguments for ${name}: missing [${list(missing)}], unexpected [${list(extra)}], not strings [${list(notStrings)}]`,
    );
  }
  return JSON.stringify(tool.run(db, given as Args));
}

// -- tasks -------------------------------------------------------------------------------
export interface Task {
  /** The customer's request: the first observation. */
  request: string;
  /** The golden actions: (tool, arguments) in order. */
  golden: [string, Args][];
}

export const TASKS: Record<string, Task> = {
  "cardio-monday": {
    request: "Hi, Mara Silva here (patient p1). I'd like the earliest cardiology appointment on Monday, please.",
    golden: [["book_appointment", { patient_id: "p1", slot_id: "s1" }]],
  },
  "cancel-derm": {
    request: "This is Tom Becker, patient p2. Please cancel my dermatology appointment.",
    golden: [["cancel_appointment", { patient_id: "p2", appointment_id: "a1" }]],
  },
  "gp-tuesday-afternoon": {
    request: "Omar Haddad (p4) speaking: any general practice appointment on Tuesday afternoon, please.",
    golden: [["book_appointment", { patient_id: "p4", slot_id: "s8" }]],
  },
  "move-derm-thursday": {
    request: "Tom (p2) again: could you move my dermatology appointment to Thursday?",
    golden: [
      ["cancel_appointment", { patient_id: "p2", appointment_id: "a1" }],
      ["book_appointment", { patient_id: "p2", slot_id: "s5" }],
    ],
  },
  "no-derm-friday": {
    request: "Mara (p1): a dermatology appointment on Friday, please; if there is none, leave everything as it is.",
    golden: [],
  },
  "two-bookings": {
    request: "I'm Omar Haddad, p4. I need a cardiology appointment on Wednesday and a general practice one on Thursday.",
    golden: [
      ["book_appointment", { patient_id: "p4", slot_id: "s3" }],
      ["book_appointment", { patient_id: "p4", slot_id: "s9" }],
    ],
  },
  "cancel-someone-else": {
    request: "I'm Mara (p1). Cancel appointment a2, please.",
    golden: [],
  },
  "earliest-gp": {
    request: "Yuki Tanaka (p3) here: the earliest general practice appointment of the week, please.",
    golden: [["book_appointment", { patient_id: "p3", slot_id: "s7" }]],
  },
};

export const SPLITS: Record<string, string[]> = {
  train: ["cardio-monday", "cancel-derm", "gp-tuesday-afternoon", "move-derm-thursday", "no-derm-friday"],
  test: ["two-bookings", "cancel-someone-else", "earliest-gp"],
};

export const POLICY =
  "You are the front desk of the Riverside clinic. The patient gives their id. Use the tools to serve " +
  "the request, then call done. Book only free slots; a patient holds at most one appointment per doctor; " +
  "never cancel or change another patient's appointment; when nothing fits the request, change nothing.";

// -- the checker -------------------------------------------------------------------------
function pairs(db: Db): Set<string> {
  return new Set(Object.values(db.appointments).map((a) => `${a.patientId}@${a.slotId}`));
}

function changes(from: Db, to: Db): string[] {
  const before = pairs(from);
  const after = pairs(to);
  const out: string[] = [];
  for (const p of after) if (!before.has(p)) out.push(`book ${p}`);
  for (const p of before) if (!after.has(p)) out.push(`cancel ${p}`);
  return out.sort();
}

export function goldenDb(taskId: string): Db {
  const db = initialDb();
  for (const [name, args] of TASKS[taskId]!.golden) callTool(db, name, JSON.stringify(args));
  return db;
}

export interface Score {
  reward: number;
  expected: string[];
  achieved: string[];
  unexpected: string[];
}

/** Scores the final state `db` of an episode on `taskId`. */
export function score(taskId: string, db: Db): Score {
  const start = initialDb();
  const expected = changes(start, goldenDb(taskId));
  const made = changes(start, db);
  const achieved = made.filter((c) => expected.includes(c));
  const unexpected = made.filter((c) => !expected.includes(c));
  let reward: number;
  if (unexpected.length > 0) reward = 0;
  else if (expected.length === 0) reward = 1;
  else reward = achieved.length / expected.length;
  return { reward, expected, achieved, unexpected };
}
