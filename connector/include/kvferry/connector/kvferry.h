/* kvferry C ABI (libkvferry.so): the same reach as the C++ kvferry::Client, for engines written
 * in C or bound from Python (ctypes/cffi). Every call returns a status code (0 = ok, otherwise a
 * kvferry_error value); kvferry_last_error() gives the message of the calling thread's last
 * failed call. No C++ exception crosses this interface.
 *
 * Versions. KVFERRY_ABI_VERSION grows by one whenever entry points or params structs are added;
 * nothing is removed or changed in place, so a program built against an older header links and
 * runs against a newer library. kvferry_abi_version() is the library's; pass your header's in
 * kvferry_connect_params.abi_version and a library older than your header refuses to connect
 * (version_mismatch) instead of misreading your structs. The wire protocol's version travels in
 * every frame: a daemon speaking another one is refused at connect with version_mismatch.
 *
 * Growing structs carry a `field_mask` (first member): the caller sets the KVFERRY_*_F_* bits of
 * the fields it filled in (input structs) or has room for (output structs; on return the mask
 * holds the fields the library wrote). Bits the library does not know are refused (input) or
 * cleared (output).
 *
 * Threads. A kvferry_client may be used from several threads at once: control calls (map, create,
 * register, debug_read) are serialized inside; submissions are serialized inside; completions are
 * taken off the ring by one waiting thread at a time and filed for whoever waits for them, so
 * submitting a data op on one thread while another thread waits is safe. kvferry_poll and
 * kvferry_wait return only raw completions (requests queued with kvferry_submit/kvferry_ping);
 * a data op's completion (kvferry_submit_*) is kept for its kvferry_wait_op and never handed to
 * poll/wait. kvferry_close must not race with any other call on the same client.
 *
 * Lifetimes. The base kvferry_map_region returns, the views (kvferry_layer_view, kvferry_kv_view)
 * and the arena stay valid until kvferry_close of that client (for a registered region: the
 * caller's buffer, which the caller owns and frees after kvferry_close). Strings returned
 * (kvferry_last_error, kvferry_status_name, kvferry_version) are owned by the library.
 *
 * A dead daemon. Every wait also watches the control socket: when kvferryd goes away (crash,
 * SIGKILL, shutdown), waits return KVFERRY_ERROR_UNAVAILABLE within milliseconds, every data op in
 * flight fails with it, and so does every later call on that client; the message says what was
 * lost. Connect again (a new client) to go on; kvferry_connection_status checks without waiting.
 *
 * CUDA. Calls that map or unmap GPU memory (map, create, close) switch the calling thread's
 * current device and restore it before they return. */
#ifndef KVFERRY_CONNECTOR_KVFERRY_H_
#define KVFERRY_CONNECTOR_KVFERRY_H_

#include <stdint.h>

#if defined(KVFERRY_C_BUILD)
#define KVFERRY_API __attribute__((visibility("default")))
#else
#define KVFERRY_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI version of this header (1: the first release; 2: versions, params structs, the full
 * status list, kvferry_connection_status; 3: the remote tier's send, lookup_wait and peers, and
 * kvferry_get_tier_stats; 4: mapped loads across geometries, kvferry_load_mapped). */
#define KVFERRY_ABI_VERSION 4

/* Every status code (the daemon's ErrorCode values; wire-stable, only appended to). */
typedef enum kvferry_error {
  KVFERRY_ERROR_OK = 0,
  KVFERRY_ERROR_INVALID_ARGUMENT = 1,   /* a parameter is malformed or inconsistent */
  KVFERRY_ERROR_OUT_OF_RANGE = 2,       /* an index (block, layer, slot) is past its bound */
  KVFERRY_ERROR_OVERFLOW = 3,           /* a size or offset does not fit in int64 */
  KVFERRY_ERROR_MISALIGNED = 4,         /* an address, offset or stride violates an alignment rule */
  KVFERRY_ERROR_NOT_FOUND = 5,          /* a key, region or client is unknown (a miss) */
  KVFERRY_ERROR_ALREADY_EXISTS = 6,     /* a unique name or key is taken */
  KVFERRY_ERROR_RESOURCE_EXHAUSTED = 7, /* a pool, ring or disk is full */
  KVFERRY_ERROR_UNAVAILABLE = 8,        /* the daemon is gone, or a capability is missing */
  KVFERRY_ERROR_INTERNAL = 9,           /* a broken invariant inside kvferry */
  KVFERRY_ERROR_UNSUPPORTED = 10,       /* a valid request kvferry does not implement */
  KVFERRY_ERROR_PROTOCOL = 11,          /* a malformed message on the wire */
  KVFERRY_ERROR_VERSION_MISMATCH = 12,  /* the peer speaks another protocol or ABI version */
  KVFERRY_ERROR_PERMISSION_DENIED = 13, /* this process's credentials are not allowed */
  KVFERRY_ERROR_CHECKSUM_MISMATCH = 14, /* stored bytes no longer match their checksum */
  KVFERRY_ERROR_TIMEOUT = 15,           /* a deadline passed */
  KVFERRY_ERROR_CANCELLED = 16,         /* the work was cancelled (client gone, shutdown) */
  KVFERRY_ERROR_IO = 17,                /* an operating-system call failed */
  KVFERRY_ERROR_CUDA = 18,              /* a CUDA call failed */
  KVFERRY_ERROR_UCX = 19,               /* a UCX call failed */
  KVFERRY_ERROR_CONFIG = 20,            /* a configuration value is invalid */
  KVFERRY_ERROR_BUSY = 21,              /* try again later (ring or arena full, block pinned) */
  KVFERRY_ERROR_DATA_LOSS = 22,         /* a stored block is gone or unreadable */
  KVFERRY_ERROR_COUNT = 23              /* one past the last code (kvferry_status_name covers all) */
} kvferry_error;

/* The same values under their first names (ABI 1). */
#define KVFERRY_OK 0
#define KVFERRY_E_BUSY 21    /* ring full: reap completions and retry */
#define KVFERRY_E_TIMEOUT 15 /* no completion in time */

#define KVFERRY_OP_PING 1
#define KVFERRY_OP_LOOKUP 16
#define KVFERRY_OP_SAVE 17
#define KVFERRY_OP_LOAD 18
#define KVFERRY_OP_PIN 19
#define KVFERRY_OP_UNPIN 20
#define KVFERRY_OP_EVICT 21
#define KVFERRY_OP_STATS 22
#define KVFERRY_OP_LS 23

/* Per-block codes of the data ops (any other value is an ErrorCode too). */
#define KVFERRY_E_NOT_FOUND 5          /* a miss: the key is not stored */
#define KVFERRY_E_EXHAUSTED 7          /* the pool is full of pinned or in-use blocks */
#define KVFERRY_E_UNSUPPORTED 10       /* no conversion from the stored format to the region's */
#define KVFERRY_E_CHECKSUM_MISMATCH 14 /* the stored copy was damaged: dropped, never returned */

/* kvferry_evict flags */
#define KVFERRY_EVICT_ALL 1    /* every unpinned block of the region's namespace (keys ignored) */
#define KVFERRY_EVICT_ALL_NS 2 /* every unpinned block of every namespace (region may be 0) */

typedef struct kvferry_client kvferry_client;

/* A request (64 bytes, the ring's slot layout). */
typedef struct kvferry_sqe {
  uint64_t id;
  uint16_t op;
  uint16_t flags;
  uint32_t region;
  uint32_t count;
  uint32_t arena_offset;
  uint64_t args[5];
} kvferry_sqe;

/* A completion (64 bytes). `status` is 0 or an error code. */
typedef struct kvferry_cqe {
  uint64_t id;
  int16_t status;
  uint16_t op;
  uint32_t count;
  uint32_t arena_offset;
  uint32_t done;
  uint64_t result[5];
} kvferry_cqe;

typedef struct kvferry_region_info {
  uint32_t id;
  char name[64];
  int64_t layers, blocks, block_size;
  char format[64]; /* EntryFormat name, e.g. "mla_fp8_ds" */
  int32_t layout;  /* 0 block_major, 1 layer_major */
  uint64_t bytes;
  int32_t backend; /* 0 memfd, 1 cuda_vmm, 2 cuda_ipc */
  int32_t device;  /* CUDA device, -1 host */
} kvferry_region_info;

/* A per-layer view: element (i0, i1, ...) is at data + sum(i_k * strides[k]) * elem_bytes. */
typedef struct kvferry_view {
  void* data;
  int32_t dtype; /* kvferry DType value */
  int32_t elem_bytes;
  int32_t rank;
  int32_t on_device; /* 1 = GPU memory */
  int64_t sizes[4];
  int64_t strides[4]; /* in elements */
  int64_t offset;     /* bytes from the region base */
} kvferry_view;

/* A 128-bit block key chosen by the engine (e.g. a chained hash of the block's token ids). */
typedef struct kvferry_key {
  uint64_t hi, lo;
} kvferry_key;

/* The daemon's store counters (kvferry_stats). */
typedef struct kvferry_stats_info {
  uint64_t entries, writing, pinned, used_bytes, capacity_bytes, evictions, evicted_bytes;
  uint64_t lookups, hits, misses, blocks_saved, bytes_saved, blocks_loaded, bytes_loaded;
  uint64_t checksum_failures, clients, pool_pinned;
} kvferry_stats_info;

/* One stored block (kvferry_ls). */
typedef struct kvferry_ls_entry {
  kvferry_key key;
  uint64_t bytes;
  uint32_t pins, reserved;
  char ns[96]; /* namespace: model|format family|tenant */
  char format[32];
  char tier[8];
} kvferry_ls_entry;

/* Message of this thread's last failed call ("" when none). Valid until the next call. */
KVFERRY_API const char* kvferry_last_error(void);
/* Stable name of a status code, e.g. "busy" ("unknown" outside 0..KVFERRY_ERROR_COUNT-1). */
KVFERRY_API const char* kvferry_status_name(int status);
/* The library's version, e.g. "0.1.0 (abi 2, protocol 1)". */
KVFERRY_API const char* kvferry_version(void);
/* The library's KVFERRY_ABI_VERSION (compare with your header's). */
KVFERRY_API uint32_t kvferry_abi_version(void);
/* The wire protocol version this library speaks. */
KVFERRY_API uint32_t kvferry_protocol_version(void);

/* socket NULL or "" = $KVFERRY_SOCKET, else /run/kvferry/kvferry.sock. */
KVFERRY_API int kvferry_connect(const char* socket, const char* client_name, kvferry_client** out);
KVFERRY_API void kvferry_close(kvferry_client* c);
KVFERRY_API int kvferry_client_id(kvferry_client* c, uint32_t* out);

KVFERRY_API int kvferry_region_count(kvferry_client* c, uint32_t* out);
KVFERRY_API int kvferry_get_region_info(kvferry_client* c, uint32_t index, kvferry_region_info* out);
KVFERRY_API int kvferry_find_region(kvferry_client* c, const char* name, uint32_t* region_id);
KVFERRY_API int kvferry_map_region(kvferry_client* c, uint32_t region_id, void** base);
/* format: EntryFormat name; layout 0 block_major, 1 layer_major. Creates (or reuses) and maps. */
KVFERRY_API int kvferry_create_region(kvferry_client* c, const char* name, int64_t layers, int64_t blocks,
                                      int64_t block_size, const char* format, int32_t layout, uint32_t* region_id);
/* Registers a buffer this process allocated: backend 0 memfd (fd sealed with F_SEAL_SHRINK),
 * 1 cuda_vmm (cuMem POSIX fd), 2 cuda_ipc (ipc_handle: 64 bytes; fd -1). `base` is where this
 * process maps it; the caller keeps ownership of the buffer and the fd. */
KVFERRY_API int kvferry_register_region(kvferry_client* c, const char* name, int64_t layers, int64_t blocks,
                                        int64_t block_size, const char* format, int32_t layout, int32_t backend, int fd,
                                        const uint8_t* ipc_handle, void* base, uint64_t alloc_bytes, int32_t device,
                                        uint32_t* region_id);
KVFERRY_API int kvferry_layer_view(kvferry_client* c, uint32_t region_id, int64_t layer, kvferry_view* out);
/* MHA K (v_plane 0) or V (v_plane 1) plane of a layer. */
KVFERRY_API int kvferry_kv_view(kvferry_client* c, uint32_t region_id, int64_t layer, int32_t v_plane,
                                kvferry_view* out);

KVFERRY_API int kvferry_submit(kvferry_client* c, const kvferry_sqe* req);
KVFERRY_API int kvferry_ping(kvferry_client* c, uint64_t id, uint64_t payload);
/* Takes up to `max` raw completions without waiting; *n = how many. Completions of data ops
 * (kvferry_submit_*) are filed for kvferry_wait_op, never returned here. */
KVFERRY_API int kvferry_poll(kvferry_client* c, kvferry_cqe* out, uint32_t max, uint32_t* n);
/* Takes at least one raw completion, waiting up to timeout_us (KVFERRY_E_TIMEOUT after;
 * KVFERRY_ERROR_UNAVAILABLE as soon as the daemon is gone). */
KVFERRY_API int kvferry_wait(kvferry_client* c, kvferry_cqe* out, uint32_t max, int64_t timeout_us, uint32_t* n);
/* The per-client shared arena for block lists. */
KVFERRY_API int kvferry_arena(kvferry_client* c, void** base, uint32_t* bytes);
/* Like kvferry_connect, with the block namespace: blocks are shared between clients of one
 * model, tenant and format family, never across (model NULL or "" = the default namespace). */
KVFERRY_API int kvferry_connect_ns(const char* socket, const char* client_name, const char* model, const char* tenant,
                                   kvferry_client** out);

/* ---- data ops: block lists go through the arena, which these calls manage ----
 * Asynchronous form: kvferry_submit_* queues a request and gives its id in *req; kvferry_wait_op
 * reaps it. The synchronous forms below submit and wait (up to 60 s).
 * Per-block results: statuses[i] (int16) is 0 or the ErrorCode of block i; *done counts the
 * blocks that succeeded. The return code of a data op is 0 when every block succeeded, else the
 * first failing block's code (the per-block statuses say which; the request itself was served). */
KVFERRY_API int kvferry_submit_lookup(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n,
                                      uint64_t* req);
KVFERRY_API int kvferry_submit_save(kvferry_client* c, uint32_t region_id, const kvferry_key* keys,
                                    const int64_t* block_ids, uint32_t n, uint64_t* req);
KVFERRY_API int kvferry_submit_load(kvferry_client* c, uint32_t region_id, const kvferry_key* keys,
                                    const int64_t* block_ids, uint32_t n, uint64_t* req);
/* Waits for request `req`: statuses (up to max_statuses, may be NULL), *done and result[5]
 * (lookup: result[0] = longest hit prefix; evict: result[0] = blocks evicted; may be NULL).
 * timeout_us 0 checks once without sleeping; KVFERRY_E_TIMEOUT leaves the request in flight (wait
 * again). KVFERRY_ERROR_UNAVAILABLE: the daemon went away first (the request is lost). Any
 * thread may wait for any request; each request's result is handed out once. */
KVFERRY_API int kvferry_wait_op(kvferry_client* c, uint64_t req, int64_t timeout_us, int16_t* statuses,
                                uint32_t max_statuses, uint32_t* done, uint64_t* result);

/* lookup: statuses[i] = 0 (stored) or KVFERRY_E_NOT_FOUND; *prefix = leading keys all stored.
 * A miss is not an error: the return code is 0 when the request was served. */
KVFERRY_API int kvferry_lookup(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n,
                               int16_t* statuses, uint32_t* prefix);
/* Saves block_ids[i] of the region under keys[i] into the daemon's host pool. */
KVFERRY_API int kvferry_save(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, const int64_t* block_ids,
                             uint32_t n, int16_t* statuses, uint32_t* done);
/* Loads keys[i] into block_ids[i] of the region, converting the format when it differs. */
KVFERRY_API int kvferry_load(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, const int64_t* block_ids,
                             uint32_t n, int16_t* statuses, uint32_t* done);
/* Pinned blocks are never evicted; pins are dropped when the client disconnects. */
KVFERRY_API int kvferry_pin(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n,
                            int16_t* statuses, uint32_t* done);
KVFERRY_API int kvferry_unpin(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n,
                              int16_t* statuses, uint32_t* done);
/* flags 0: the given keys (statuses: 0 evicted, KVFERRY_E_NOT_FOUND, 21 busy = pinned or in use);
 * KVFERRY_EVICT_ALL / KVFERRY_EVICT_ALL_NS: keys ignored. *evicted = blocks evicted. */
KVFERRY_API int kvferry_evict(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n,
                              uint64_t flags, int16_t* statuses, uint64_t* evicted);
KVFERRY_API int kvferry_stats(kvferry_client* c, kvferry_stats_info* out);
/* Up to `max` stored blocks of the region's namespace (region 0 = every namespace); *n written. */
KVFERRY_API int kvferry_ls(kvferry_client* c, uint32_t region_id, kvferry_ls_entry* out, uint32_t max, uint32_t* n);

/* Reads region bytes through the daemon's own mapping (debugging/tests). */
KVFERRY_API int kvferry_debug_read(kvferry_client* c, uint32_t region_id, uint64_t offset, void* dst, uint32_t bytes);

/* ---- ABI 2: params structs with a field_mask, beside the calls above ---- */

/* 0 while the daemon holds the connection, KVFERRY_ERROR_UNAVAILABLE (with what was lost in
 * kvferry_last_error) once it closed it. Does not wait. */
KVFERRY_API int kvferry_connection_status(kvferry_client* c);

#define KVFERRY_CONNECT_F_ABI_VERSION (1u << 0)
#define KVFERRY_CONNECT_F_SOCKET (1u << 1)
#define KVFERRY_CONNECT_F_CLIENT_NAME (1u << 2)
#define KVFERRY_CONNECT_F_NAMESPACE (1u << 3) /* model and tenant */
#define KVFERRY_CONNECT_F_TIMEOUT_MS (1u << 4)
#define KVFERRY_CONNECT_F_SPIN_US (1u << 5)
#define KVFERRY_CONNECT_F_ALL_V2 0x3fu
typedef struct kvferry_connect_params {
  uint64_t field_mask;
  uint32_t abi_version;    /* KVFERRY_ABI_VERSION of the caller's header */
  int32_t timeout_ms;      /* bound on each control round trip (default 5000) */
  const char* socket;      /* NULL or "" = $KVFERRY_SOCKET, else /run/kvferry/kvferry.sock */
  const char* client_name; /* shown by `kvferry status` */
  const char* model;       /* block namespace: model (NULL or "" = the default namespace) */
  const char* tenant;      /* block namespace: tenant (the daemon may enforce its own) */
  int64_t spin_us;         /* waits spin this long before sleeping (default 50) */
} kvferry_connect_params;
KVFERRY_API int kvferry_connect_with(const kvferry_connect_params* p, kvferry_client** out);

#define KVFERRY_REGION_F_SPEC (1u << 0)   /* name, layers, blocks, block_size, format, layout */
#define KVFERRY_REGION_F_BUFFER (1u << 1) /* backend, fd, ipc_handle, base, alloc_bytes, device */
#define KVFERRY_REGION_F_ALL_V2 0x3u
#define KVFERRY_REGION_F_OFFSET (1u << 2) /* offset (ABI 4) */
#define KVFERRY_REGION_F_ALL_V4 0x7u
typedef struct kvferry_region_params {
  uint64_t field_mask;
  const char* name;
  int64_t layers, blocks, block_size;
  const char* format;        /* EntryFormat name: "mla_fp8_ds", "mha:bf16:8x128:nhd", ... */
  int32_t layout;            /* 0 block_major, 1 layer_major */
  int32_t backend;           /* register only: 0 memfd (sealed F_SEAL_SHRINK), 1 cuda_vmm, 2 cuda_ipc */
  int32_t fd;                /* register only: memfd or cuMem POSIX fd (the caller keeps it); -1 for cuda_ipc */
  int32_t device;            /* register only: CUDA device, -1 for host memory */
  const uint8_t* ipc_handle; /* register only: 64-byte cudaIpcMemHandle for cuda_ipc */
  void* base;                /* register only: where this process maps the buffer */
  uint64_t alloc_bytes;      /* register only: bytes of the buffer (>= offset + the region's bytes) */
  /* register only (KVFERRY_REGION_F_OFFSET): the region starts this many bytes into the buffer
   * (a KV tensor inside a larger allocation: an IPC handle or cuMem fd names the whole
   * allocation; base is where the buffer, not the region, is mapped). A multiple of the format's
   * alignment; only the registering client maps such a region. */
  uint64_t offset;
} kvferry_region_params;
/* Creates (or reuses) and maps a daemon-owned region: needs KVFERRY_REGION_F_SPEC. */
KVFERRY_API int kvferry_create_region_with(kvferry_client* c, const kvferry_region_params* p, uint32_t* region_id);
/* Registers a buffer this process allocated: needs KVFERRY_REGION_F_SPEC | KVFERRY_REGION_F_BUFFER
 * (the params form of kvferry_register_region). */
KVFERRY_API int kvferry_register_region_with(kvferry_client* c, const kvferry_region_params* p, uint32_t* region_id);

#define KVFERRY_REGION_DESC_F_BASIC (1u << 0)   /* id .. device (the fields of kvferry_region_info) */
#define KVFERRY_REGION_DESC_F_MAPPING (1u << 1) /* mapped, base, block_bytes */
#define KVFERRY_REGION_DESC_F_ALL_V2 0x3u
typedef struct kvferry_region_desc {
  uint64_t field_mask;
  uint32_t id;
  int32_t layout; /* 0 block_major, 1 layer_major */
  char name[64];
  char format[64];
  int64_t layers, blocks, block_size;
  uint64_t bytes;
  int32_t backend; /* 0 memfd, 1 cuda_vmm, 2 cuda_ipc */
  int32_t device;  /* CUDA device, -1 host */
  int32_t mapped;  /* 1 when mapped into this process */
  int32_t reserved;
  void* base;           /* the mapping (NULL when not mapped) */
  uint64_t block_bytes; /* bytes of one block, all layers (block_major: one contiguous range) */
} kvferry_region_desc;
/* Region `region_id` as this client knows it (offered at connect, created, mapped or registered). */
KVFERRY_API int kvferry_describe_region(kvferry_client* c, uint32_t region_id, kvferry_region_desc* out);

#define KVFERRY_STATS_F_STORE (1u << 0) /* the fields of kvferry_stats_info */
#define KVFERRY_STATS_F_ALL_V2 0x1u
typedef struct kvferry_store_stats {
  uint64_t field_mask;
  uint64_t entries, writing, pinned, used_bytes, capacity_bytes, evictions, evicted_bytes;
  uint64_t lookups, hits, misses, blocks_saved, bytes_saved, blocks_loaded, bytes_loaded;
  uint64_t checksum_failures, clients, pool_pinned;
} kvferry_store_stats;
KVFERRY_API int kvferry_get_stats(kvferry_client* c, kvferry_store_stats* out);

/* The daemon's status as JSON (the shape of `kvferry status --json`: version, uptime_s, pid,
 * backend, regions[], clients[]), NUL-terminated into buf (cap bytes). *needed = bytes with the
 * NUL; KVFERRY_ERROR_OUT_OF_RANGE when cap is smaller (call again with *needed). */
KVFERRY_API int kvferry_daemon_status_json(kvferry_client* c, char* buf, uint32_t cap, uint32_t* needed);

/* ---- ABI 3: the remote tier (tiers.remote), every tier's stats ---- */

/* Prefill → decode: saves block_ids[i] under keys[i] here, then writes the blocks to the peer
 * daemon whose member id is `peer` (as kvferry_peers_json lists it), so that the peer's clients
 * find them. statuses[i] = 0 once stored on the peer and verified there, else the error
 * (KVFERRY_ERROR_UNAVAILABLE: the peer is lost or unreachable; KVFERRY_E_NOT_FOUND: no such peer).
 * The call fails with KVFERRY_ERROR_UNAVAILABLE when the daemon has no remote tier. */
KVFERRY_API int kvferry_send(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, const int64_t* block_ids,
                             uint32_t n, const char* peer, int16_t* statuses, uint32_t* done);
/* kvferry_send whose blocks also land in region `peer_region` of the peer, at peer_block_ids[i]
 * (the decode engine's blocks, one per key, n of them): statuses[i] = 0 once loaded there. The
 * region must be one the blocks' tenant reaches on the peer (its own or a shared one). */
KVFERRY_API int kvferry_send_into(kvferry_client* c, uint32_t region_id, const kvferry_key* keys,
                                  const int64_t* block_ids, uint32_t n, const char* peer, uint32_t peer_region,
                                  const int64_t* peer_block_ids, int16_t* statuses, uint32_t* done);
/* A lookup that waits up to wait_ms for keys not stored yet (a peer's send landing): statuses[i]
 * = 0 once stored, KVFERRY_E_NOT_FOUND if still absent then. Without a remote tier it does not wait. */
KVFERRY_API int kvferry_lookup_wait(kvferry_client* c, uint32_t region_id, const kvferry_key* keys, uint32_t n,
                                    uint32_t wait_ms, int16_t* statuses, uint32_t* prefix);
/* The remote tier's members as JSON ({"self", "healthy", "reason", "members": [{"id", "address",
 * "incarnation", "state", "blocks_out", "bytes_out", "blocks_in", "bytes_in", "errors"}]}),
 * NUL-terminated into buf (cap bytes). *needed = bytes with the NUL; KVFERRY_ERROR_OUT_OF_RANGE
 * when cap is smaller; KVFERRY_ERROR_UNAVAILABLE without a remote tier. */
KVFERRY_API int kvferry_peers_json(kvferry_client* c, char* buf, uint32_t cap, uint32_t* needed);

/* Every lower tier's figures, named by tier (kvferry_get_stats has the host pool's). */
#define KVFERRY_TIER_F_BASIC (1u << 0)   /* tier, healthy, reason */
#define KVFERRY_TIER_F_STORAGE (1u << 1) /* capacity_bytes .. bytes_read: a tier with storage (disk) */
#define KVFERRY_TIER_F_PEERS (1u << 2)   /* member .. errors: the remote tier's cluster */
#define KVFERRY_TIER_F_ALL_V3 0x7u
typedef struct kvferry_tier_stats {
  uint64_t field_mask;
  char tier[8];    /* "disk", "remote" */
  int32_t healthy; /* 1 while the tier works, 0 degraded (reason says why) */
  int32_t reserved;
  char reason[64];                                     /* "" while healthy */
  uint64_t capacity_bytes, used_bytes, blocks, pinned; /* the tier's storage (slot sizes, not block sizes) */
  uint64_t evictions, io_errors, checksum_failures, bytes_written, bytes_read;
  char member[64];                 /* this daemon's member id */
  uint64_t peers_live, peers_lost; /* other members: live or connected / unreachable or gone */
  uint64_t blocks_out, bytes_out;  /* pushed to peers (summed over them) */
  uint64_t blocks_in, bytes_in;    /* fetched from peers */
  uint64_t errors;                 /* blocks that failed on a peer's account */
} kvferry_tier_stats;
/* One entry per lower tier the daemon runs (disk, then remote), up to `max`; *n = entries
 * written (0 for a host-only daemon; max 0 asks nothing of the daemon). Set each entry's
 * field_mask to the KVFERRY_TIER_F_* bits it has room for; on return it holds those the tier
 * has: BASIC always, STORAGE for the disk, PEERS for the remote tier (fields outside it are
 * left as they were). A NULL client or n, or a NULL out with max > 0, is
 * KVFERRY_ERROR_INVALID_ARGUMENT. */
KVFERRY_API int kvferry_get_tier_stats(kvferry_client* c, kvferry_tier_stats* out, uint32_t max, uint32_t* n);

/* ---- loads across geometries (ABI 4) ----
 * Entry i puts part parts[i] of the stored block keys[i] into block block_ids[i] of the region.
 * With stored pages larger than the region's (64 -> 16 tokens), part p is the stored tokens
 * [p*R, (p+1)*R), a whole region block; with smaller ones (16 -> 64), the stored block fills
 * region tokens [p*S, (p+1)*S). MHA regions registered with a head slice
 * ("mha:bf16:4x128:hnd:slice=4/8": heads 4..7 of 8, one tensor-parallel rank's) get the heads
 * they hold out of blocks saved with all heads or with other slices (one entry per slice), and
 * NHD <-> HND and the MLA format conversions apply on the way. A region block's entries must
 * cover each of its tokens and heads once; they succeed or fail together, and a failed region
 * block is left untouched (statuses[i] of each of its entries names the cause). A plain
 * kvferry_load maps head slices and orders block for block on its own. */
KVFERRY_API int kvferry_submit_load_mapped(kvferry_client* c, uint32_t region_id, const kvferry_key* keys,
                                           const int64_t* block_ids, const int32_t* parts, uint32_t n, uint64_t* req);
KVFERRY_API int kvferry_load_mapped(kvferry_client* c, uint32_t region_id, const kvferry_key* keys,
                                    const int64_t* block_ids, const int32_t* parts, uint32_t n, int16_t* statuses,
                                    uint32_t* done);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_CONNECTOR_KVFERRY_H_ */
