/* kvferry C ABI (libkvferry.so): the same reach as the C++ kvferry::Client, for engines written
 * in C or bound from Python (ctypes/cffi). Every call returns a status code (0 = ok, otherwise a
 * kvferry ErrorCode value); kvferry_last_error() gives the message of the calling thread's last
 * failed call. No C++ exception crosses this interface. */
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
/* Stable name of a status code, e.g. "busy". */
KVFERRY_API const char* kvferry_status_name(int status);

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
/* Takes up to `max` completions without waiting; *n = how many. */
KVFERRY_API int kvferry_poll(kvferry_client* c, kvferry_cqe* out, uint32_t max, uint32_t* n);
/* Takes at least one completion, waiting up to timeout_us (KVFERRY_E_TIMEOUT after). */
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
 * (lookup: result[0] = longest hit prefix; evict: result[0] = blocks evicted; may be NULL). */
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

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_CONNECTOR_KVFERRY_H_ */
