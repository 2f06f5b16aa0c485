#pragma once
// Convenience umbrella for the layouts module.
#include "kvferry/layouts/dtype.h"
#include "kvferry/layouts/entry_format.h"
#include "kvferry/layouts/kv_cache_spec.h"
#include "kvferry/layouts/status.h"
#include "kvferry/layouts/tensor_view.h"
