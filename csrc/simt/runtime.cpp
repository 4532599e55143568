// The scheduler of runtime.h: a launch's blocks run one after another; the
// threads of a block are fibers (their own stacks, switched by hand on x86-64,
// by ucontext elsewhere) that run one at a time, each until it reaches a warp
// collective, an atomic or its end. When every lane of a collective's mask is
// waiting there, the collective's results are given and the lanes run on.
#include "simt/runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define SIMT_ASAN 1
#else
#define SIMT_ASAN 0
#endif

namespace simt {
namespace {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;

#if defined(__x86_64__)
// simt_switch(save, to): saves the callee-saved registers on the current stack,
// stores its pointer in *save, and resumes the stack `to` (System V x86-64).
extern "C" void simt_switch(void** save, void* to);
extern "C" void simt_fiber_start();
asm(R"(
.text
.globl simt_switch
.type simt_switch,@function
simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size simt_switch, .-simt_switch
.globl simt_fiber_start
.type simt_fiber_start,@function
simt_fiber_start:
  call simt_fiber_main@PLT
  ud2
.size simt_fiber_start, .-simt_fiber_start
)");
#endif

enum class State { kReady, kWaiting, kExited };

struct Lane {
  char* stack = nullptr;  // lowest usable byte (a guard page below)
  void* sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t context;
#endif
  void* fake_stack = nullptr;
  Dim3 idx;
  State state = State::kReady;
  Kind kind = Kind::kSyncwarp;
  Site site{nullptr, 0, 0};
  unsigned mask = 0;
  uint64_t value = 0;
  int arg = 0;
  uint64_t result = 0;
};

// The launch in flight (one at a time: launch_mutex).
struct Grid {
  LaunchConfig config;
  Dim3 grid_dim, block_dim, block_idx;
  std::vector<Lane>* lanes = nullptr;
  int threads = 0;
  Lane* current = nullptr;
  void* scheduler_sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t scheduler_context;
#endif
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_size = 0;
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  std::string error;
  std::mt19937_64 rng;
};

Grid* g = nullptr;
std::mutex launch_mutex;
std::vector<Lane> lane_pool;  // stacks kept between launches

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kShfl: return "__shfl_sync";
    case Kind::kShflXor: return "__shfl_xor_sync";
    case Kind::kBallot: return "__ballot_sync";
    case Kind::kAny: return "__any_sync";
    default: return "__syncwarp";
  }
}

std::string where(const Lane& l) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%s at %s:%d (mask %#x)", kind_name(l.kind), l.site.file,
                l.site.line, l.mask);
  return buf;
}

std::string format(const char* f, va_list args) {
  char buf[2048];
  std::vsnprintf(buf, sizeof(buf), f, args);
  return buf;
}

void set_error(const char* f, ...) {
  if (!g->error.empty()) return;
  va_list args;
  va_start(args, f);
  char head[128];
  std::snprintf(head, sizeof(head), "block %u, ", g->block_idx.x);
  g->error = head + format(f, args);
  va_end(args);
}

// Switches from lane `from` (null: the scheduler) to lane `to` (null: the scheduler).
void switch_to(Lane* from, Lane* to) {
#if SIMT_ASAN
  const void* bottom = to ? to->stack : g->scheduler_stack;
  const size_t size = to ? kStackBytes : g->scheduler_stack_size;
  void** fake = from ? (from->state == State::kExited ? nullptr : &from->fake_stack) : nullptr;
  void* scheduler_fake = nullptr;
  __sanitizer_start_switch_fiber(from ? fake : &scheduler_fake, bottom, size);
#endif
#if defined(__x86_64__)
  simt_switch(from ? &from->sp : &g->scheduler_sp, to ? to->sp : g->scheduler_sp);
#else
  swapcontext(from ? &from->context : &g->scheduler_context,
              to ? &to->context : &g->scheduler_context);
#endif
#if SIMT_ASAN
  if (from) {
    __sanitizer_finish_switch_fiber(from->fake_stack, nullptr, nullptr);
  } else {
    __sanitizer_finish_switch_fiber(scheduler_fake, nullptr, nullptr);
  }
#endif
}

void suspend(State state) {
  Lane* self = g->current;
  self->state = state;
  switch_to(self, nullptr);
}

}  // namespace

extern "C" void simt_fiber_main() {
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g->scheduler_stack, &g->scheduler_stack_size);
#endif
  g->body(g->ctx);
  suspend(State::kExited);
  __builtin_trap();  // an exited lane is never resumed
}

namespace {

#if !defined(__x86_64__)
void context_entry() { simt_fiber_main(); }
#endif

void allocate_stacks(int threads) {
  while (static_cast<int>(lane_pool.size()) < threads) {
    void* mem = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) throw std::bad_alloc();
    mprotect(mem, kGuardBytes, PROT_NONE);  // an overflow faults, never corrupts
    lane_pool.emplace_back();
    lane_pool.back().stack = static_cast<char*>(mem) + kGuardBytes;
  }
}

// A fresh stack for lane l, which will start in simt_fiber_main.
void reset_lane(Lane& l) {
  l.state = State::kReady;
  l.fake_stack = nullptr;
#if defined(__x86_64__)
  // From the 16-aligned top: the start address that simt_switch's ret takes, and
  // six registers it pops (rsp is 16-aligned at simt_fiber_start's call).
  void** top = reinterpret_cast<void**>(l.stack + kStackBytes);
  *--top = reinterpret_cast<void*>(&simt_fiber_start);
  for (int r = 0; r < 6; ++r) *--top = nullptr;
  l.sp = top;
#else
  getcontext(&l.context);
  l.context.uc_stack.ss_sp = l.stack;
  l.context.uc_stack.ss_size = kStackBytes;
  l.context.uc_link = nullptr;
  makecontext(&l.context, context_entry, 0);
#endif
}

std::vector<int> order_of(int n) {
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  const Order o = static_cast<Order>(g->config.order);
  if (o == Order::kReverse) std::reverse(order.begin(), order.end());
  if (o == Order::kShuffled) std::shuffle(order.begin(), order.end(), g->rng);
  return order;
}

// Gives the results of the collective lane `first` waits at, if every lane of its
// mask waits there too. Returns whether it did; sets the error on a misuse.
bool resolve(Lane* warp, int lanes, int first) {
  Lane& l = warp[first];
  const unsigned mask = l.mask;
  if (!(mask >> first & 1u)) {
    set_error("lane %d calls %s, whose mask leaves the lane out", first, where(l).c_str());
    return false;
  }
  for (int b = 0; b < kWarp; ++b) {
    if (!(mask >> b & 1u)) continue;
    if (b >= lanes) {
      set_error("%s names lane %d, which the block (blockDim.x %u) does not have",
                where(l).c_str(), b, g->block_dim.x);
      return false;
    }
    const Lane& o = warp[b];
    if (o.state == State::kReady) return false;  // still on its way
    if (o.state == State::kExited) {
      set_error("lane %d waits at %s, but lane %d of its mask has exited without reaching it",
                first, where(l).c_str(), b);
      return false;
    }
    if (o.kind != l.kind || o.site.id != l.site.id || o.mask != mask) {
      set_error("the lanes of one mask are at different collectives: lane %d at %s, lane %d "
                "at %s",
                first, where(l).c_str(), b, where(o).c_str());
      return false;
    }
  }
  uint64_t ballot = 0;
  for (int b = 0; b < kWarp; ++b) {
    if (mask >> b & 1u && warp[b].value) ballot |= 1ull << b;
  }
  for (int b = 0; b < kWarp; ++b) {
    if (!(mask >> b & 1u)) continue;
    Lane& x = warp[b];
    int src = -1;
    if (l.kind == Kind::kShfl) src = x.arg & (kWarp - 1);
    if (l.kind == Kind::kShflXor) src = b ^ x.arg;
    if (src >= 0 && (src >= kWarp || !(mask >> src & 1u))) {
      set_error("lane %d reads lane %d, outside the mask of %s", b, src, where(l).c_str());
      return false;
    }
    switch (l.kind) {
      case Kind::kShfl:
      case Kind::kShflXor: x.result = warp[src].value; break;
      case Kind::kBallot: x.result = ballot; break;
      case Kind::kAny: x.result = ballot != 0; break;
      default: x.result = 0; break;
    }
  }
  for (int b = 0; b < kWarp; ++b) {
    if (mask >> b & 1u) warp[b].state = State::kReady;
  }
  return true;
}

std::string waiting_lanes() {
  std::string out;
  for (int t = 0; t < g->threads; ++t) {
    const Lane& l = (*g->lanes)[t];
    if (l.state != State::kWaiting) continue;
    out += "\n  thread " + std::to_string(t) + " waits at " + where(l);
    if (out.size() > 1500) return out + "\n  ...";
  }
  return out;
}

// Runs the threads of the current block to their ends; false on an error.
bool run_block() {
  std::vector<Lane>& lanes = *g->lanes;
  for (int t = 0; t < g->threads; ++t) {
    reset_lane(lanes[t]);
    lanes[t].idx = Dim3{static_cast<unsigned>(t), 0, 0};
  }
  while (true) {
    bool ran = false;
    for (int t : order_of(g->threads)) {
      if (lanes[t].state != State::kReady) continue;
      g->current = &lanes[t];
      switch_to(nullptr, &lanes[t]);
      g->current = nullptr;
      ran = true;
    }
    if (!g->error.empty()) return false;
    bool resolved = false, running = false;
    for (int w = 0; w * kWarp < g->threads; ++w) {
      Lane* warp = lanes.data() + w * kWarp;
      const int n = std::min(kWarp, g->threads - w * kWarp);
      for (int b = 0; b < n; ++b) {
        if (warp[b].state == State::kWaiting) resolved |= resolve(warp, n, b);
        if (!g->error.empty()) return false;
        running |= warp[b].state != State::kExited;
      }
    }
    if (!running) return true;
    if (!ran && !resolved) {
      set_error("the lanes wait forever:%s", waiting_lanes().c_str());
      return false;
    }
  }
}

// Reports of the undefined-behaviour sanitizer (written to stderr) go, during a
// launch, to a file of this runtime's: what a launch added there fails it. (The
// file takes stderr's place, fd 2, for the launch: every copy of this runtime in a
// process, one per library, sees its own launches' reports; the sanitizer's report
// hook would be bound to the first copy loaded.)
class UbsanReports {
 public:
  // Starts a launch's reports; false when the file cannot be made, or under the
  // address sanitizer (a report ends the process there: it stays on stderr).
  bool start() {
    if (SIMT_ASAN) return false;
    if (file_ == nullptr) file_ = std::tmpfile();
    if (file_ == nullptr) return false;
    before_ = lseek(fileno(file_), 0, SEEK_END);
    std::fflush(stderr);
    saved_ = dup(2);
    if (before_ < 0 || saved_ < 0 || dup2(fileno(file_), 2) < 0) {
      if (saved_ >= 0) close(saved_);
      return false;
    }
    return true;
  }
  // Ends them (stderr is stderr again); the text the launch added, or "".
  std::string finish() {
    std::fflush(stderr);
    dup2(saved_, 2);
    close(saved_);
    const off_t after = lseek(fileno(file_), 0, SEEK_END);
    if (after <= before_) return std::string();
    std::string text(static_cast<size_t>(after - before_), '\0');
    if (pread(fileno(file_), &text[0], text.size(), before_) < 0) text = "(unreadable report)";
    return text;
  }

 private:
  FILE* file_ = nullptr;
  off_t before_ = 0;
  int saved_ = -1;
};
UbsanReports ubsan;

struct Grid;
bool run_blocks(Grid& grid, void* shared, size_t shared_capacity);

// A launch's memory faults (SIGSEGV, SIGBUS in a lane) end the launch with an
// error, as a GPU reports an illegal address, instead of ending the process.
sigjmp_buf fault_jump;
void* fault_address = nullptr;
int fault_thread = -1;
struct sigaction saved_segv, saved_bus;
alignas(16) char fault_stack[64 * 1024];

void on_fault(int sig, siginfo_t* info, void*) {
  if (g == nullptr || g->current == nullptr) {  // not a lane's: the previous handler's
    sigaction(SIGSEGV, &saved_segv, nullptr);
    sigaction(SIGBUS, &saved_bus, nullptr);
    return;  // the access faults again, under that handler
  }
  fault_address = info->si_addr;
  fault_thread = static_cast<int>(g->current - g->lanes->data());
  siglongjmp(fault_jump, sig);
}

void catch_faults() {
  stack_t alt{};
  alt.ss_sp = fault_stack;
  alt.ss_size = sizeof(fault_stack);
  sigaltstack(&alt, nullptr);  // a lane's stack overflow faults on its guard page
  struct sigaction action {};
  action.sa_sigaction = on_fault;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &saved_segv);
  sigaction(SIGBUS, &action, &saved_bus);
}

void release_faults() {
  sigaction(SIGSEGV, &saved_segv, nullptr);
  sigaction(SIGBUS, &saved_bus, nullptr);
}

}  // namespace

const Dim3& thread_idx() { return g->current->idx; }
const Dim3& block_idx() { return g->block_idx; }
const Dim3& block_dim() { return g->block_dim; }
const Dim3& grid_dim() { return g->grid_dim; }

uint64_t collective(Kind kind, Site site, unsigned mask, uint64_t value, int arg) {
  Lane* self = g->current;
  self->kind = kind;
  self->site = site;
  self->mask = mask;
  self->value = value;
  self->arg = arg;
  suspend(State::kWaiting);
  return self->result;
}

void yield_point() {
  if (g != nullptr && g->current != nullptr) suspend(State::kReady);
}

int fail(char* error, size_t error_size, const char* f, ...) {
  va_list args;
  va_start(args, f);
  const std::string message = format(f, args);
  va_end(args);
  std::snprintf(error, error_size, "%s", message.c_str());
  return 1;
}

int run(const LaunchConfig& config, void (*body)(void*), void* ctx, void* shared,
        size_t shared_capacity, char* error, size_t error_size) {
  std::lock_guard<std::mutex> lock(launch_mutex);
  if (config.grid < 1 || config.block < 1 || config.block > 1024) {
    return fail(error, error_size, "a launch of %lld blocks of %lld threads",
                static_cast<long long>(config.grid), static_cast<long long>(config.block));
  }
  if (config.shared_bytes < 0 || static_cast<size_t>(config.shared_bytes) > shared_capacity) {
    return fail(error, error_size, "%lld bytes of dynamic shared memory asked, %zu at most",
                static_cast<long long>(config.shared_bytes), shared_capacity);
  }
  Grid grid;
  grid.config = config;
  grid.grid_dim = Dim3{static_cast<unsigned>(config.grid), 1, 1};
  grid.block_dim = Dim3{static_cast<unsigned>(config.block), 1, 1};
  grid.threads = static_cast<int>(config.block);
  grid.body = body;
  grid.ctx = ctx;
  grid.rng.seed(config.seed);
  allocate_stacks(grid.threads);
  grid.lanes = &lane_pool;
  g = &grid;
  const bool reporting = ubsan.start();
  bool ok = true;
  catch_faults();
  if (sigsetjmp(fault_jump, 1) != 0) {
    char where[128];
    std::snprintf(where, sizeof(where), "illegal memory access at %p (thread %d of block %u)",
                  fault_address, fault_thread, grid.block_idx.x);
    grid.error = where;
    ok = false;
  } else {
    ok = run_blocks(grid, shared, shared_capacity);
  }
  release_faults();
#if SIMT_ASAN
  if (shared != nullptr) ASAN_UNPOISON_MEMORY_REGION(shared, shared_capacity);
#endif
  g = nullptr;
  const std::string report = reporting ? ubsan.finish() : std::string();
  if (!report.empty()) {
    grid.error = "undefined behaviour: " + report.substr(0, 1500);
    ok = false;
  }
  if (!ok) return fail(error, error_size, "%s", grid.error.c_str());
  return 0;
}

namespace {

// The blocks of the launch in flight, in the launch's order; false on an error.
bool run_blocks(Grid& grid, void* shared, size_t shared_capacity) {
  const LaunchConfig& config = grid.config;
  bool ok = true;
  for (int64_t b : [&] {
         std::vector<int64_t> blocks(config.grid);
         std::iota(blocks.begin(), blocks.end(), 0);
         if (config.order == static_cast<int>(Order::kReverse)) {
           std::reverse(blocks.begin(), blocks.end());
         }
         if (config.order == static_cast<int>(Order::kShuffled)) {
           std::shuffle(blocks.begin(), blocks.end(), grid.rng);
         }
         return blocks;
       }()) {
    grid.block_idx = Dim3{static_cast<unsigned>(b), 0, 0};
    if (shared != nullptr) {
#if SIMT_ASAN
      ASAN_UNPOISON_MEMORY_REGION(shared, shared_capacity);
#endif
      std::memset(shared, 0xFF, shared_capacity);
#if SIMT_ASAN
      ASAN_POISON_MEMORY_REGION(static_cast<char*>(shared) + config.shared_bytes,
                                shared_capacity - config.shared_bytes);
#endif
    }
    ok = run_block();
    if (!ok) break;
  }
  return ok;
}

}  // namespace

}  // namespace simt
