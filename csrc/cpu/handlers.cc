// XLA FFI handlers of the CPU platform: sprnn_{rnn,lstm,gru}_{fwd,bwd} (docs/INTERFACE.md),
// and the pybind11 module _sprnn_cpu that hands them to jax_sprnn/_ffi.py as capsules.
//
// Each handler collects its buffers into a `Call`, which is validated in one place (every
// shape against T, B, H, G, nnz and groups; one float dtype; the packed layout's contents)
// and then dispatched on dtype x cell to the templates in recurrence.h.

#include <pybind11/pybind11.h>

#include <climits>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <new>
#include <string>

#include "cpu/recurrence.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sprnn::cpu {
namespace {

// One buffer of a call, type-erased. `present` is false for buffers the cell does not have.
struct Arr {
  bool present = false;
  const char* name = "";
  ffi::DataType dtype = ffi::DataType::INVALID;
  ffi::AnyBuffer::Dimensions dims{nullptr, 0};
  void* data = nullptr;
};

Arr arr(const char* name, const ffi::AnyBuffer& b) {
  return Arr{true, name, b.element_type(), b.dimensions(), b.untyped_data()};
}
Arr arr(const char* name, const ffi::Buffer<ffi::S32>& b) {
  return Arr{true, name, b.element_type(), b.dimensions(), b.untyped_data()};
}

// All buffers any target may have; which are present depends on the cell and direction.
struct Call {
  // inputs
  Arr xp, lengths, values, col_idx, row_ptr, c0, h0, b_hn;
  Arr ys, cs, dys, dcT, dhT;  // backward residuals and cotangents
  // outputs
  Arr ys_out, cs_out, hT, cT;                  // forward
  Arr dxp, dvalues, dc0, dh0, db_hn;           // backward
};

const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    default: return "an unsupported dtype";
  }
}

// "(3, 4, 24)". No iostreams in the handlers: a std::ostringstream here segfaulted under jaxlib
// 0.11 with a statically linked libstdc++ (session 97, BUILD_NOTES.md).
template <typename Extents>
std::string dims_str(const Extents& d) {
  std::string s = "(";
  size_t i = 0;
  for (int64_t x : d) s += (i++ ? ", " : "") + std::to_string(x);
  return s + (d.size() == 1 ? ",)" : ")");
}

// Collects the first problem of a call as a readable message.
class Validator {
 public:
  explicit Validator(const char* target) : target_(target) {}

  bool ok() const { return error_.empty(); }

  void fail(const std::string& msg) {
    if (ok()) error_ = std::string(target_) + ": " + msg;
  }

  void shape(const Arr& a, std::initializer_list<int64_t> want) {
    if (!a.present || !ok()) return;
    bool same = a.dims.size() == want.size();
    size_t i = 0;
    for (int64_t w : want) same = same && a.dims[i++] == w;
    if (!same) {
      fail(std::string(a.name) + " has shape " + dims_str(a.dims) + ", expected " +
           dims_str(want));
    }
  }

  void dtype(const Arr& a, ffi::DataType want) {
    if (!a.present || !ok() || a.dtype == want) return;
    fail(std::string(a.name) + " has dtype " + dtype_name(a.dtype) + ", expected " +
         dtype_name(want) + " (the dtype of xp)");
  }

  ffi::Error result() const {
    return ok() ? ffi::Error::Success() : ffi::Error::InvalidArgument(error_);
  }

 private:
  const char* target_;
  std::string error_;
};

// Checks every buffer of the call against the others; fills d.
ffi::Error validate(const char* target, Cell cell, const Call& c, int64_t groups, Dims& d) {
  Validator v(target);
  const int64_t G = gates_of(cell);
  if (c.xp.dims.size() != 3) {
    v.fail("xp must have rank 3 (T, B, G*H), got shape " + dims_str(c.xp.dims));
    return v.result();
  }
  if (c.h0.dims.size() != 2) {
    v.fail("h0 must have rank 2 (B, H), got shape " + dims_str(c.h0.dims));
    return v.result();
  }
  if (c.values.dims.size() != 1) {
    v.fail("values must have rank 1 (nnz,), got shape " + dims_str(c.values.dims));
    return v.result();
  }
  const ffi::DataType ft = c.xp.dtype;
  if (ft != ffi::DataType::F32 && ft != ffi::DataType::BF16 && ft != ffi::DataType::F16) {
    v.fail(std::string("xp has dtype ") + dtype_name(ft) +
           "; supported: float32, bfloat16, float16");
    return v.result();
  }
  d.T = c.xp.dims[0];
  d.B = c.xp.dims[1];
  d.H = c.h0.dims[1];
  d.G = G;
  d.nnz = c.values.dims[0];
  const int64_t T = d.T, B = d.B, H = d.H, nnz = d.nnz;
  v.shape(c.xp, {T, B, G * H});
  v.shape(c.h0, {B, H});
  v.shape(c.lengths, {B});
  v.shape(c.col_idx, {nnz});
  v.shape(c.row_ptr, {G * H + 1});
  for (const Arr* a : {&c.c0, &c.dcT, &c.dhT, &c.hT, &c.cT, &c.dc0, &c.dh0}) v.shape(*a, {B, H});
  for (const Arr* a : {&c.ys, &c.cs, &c.dys, &c.ys_out, &c.cs_out}) v.shape(*a, {T, B, H});
  v.shape(c.b_hn, {H});
  v.shape(c.dxp, {T, B, G * H});
  v.shape(c.dvalues, {groups, nnz});
  v.shape(c.db_hn, {groups, H});
  for (const Arr* a : {&c.values, &c.c0, &c.h0, &c.b_hn, &c.ys, &c.cs, &c.dys, &c.dcT, &c.dhT,
                       &c.ys_out, &c.cs_out, &c.hT, &c.cT, &c.dxp, &c.dvalues, &c.dc0, &c.dh0,
                       &c.db_hn}) {
    v.dtype(*a, ft);
  }
  if (!v.ok()) return v.result();
  if (c.dvalues.present && (groups < 1 || B % groups != 0)) {
    v.fail("groups = " + std::to_string(groups) + " must be >= 1 and divide the batch B = " +
           std::to_string(B));
    return v.result();
  }
  if (H * B > INT32_MAX) {  // the kernels keep col * B in int32
    v.fail("H * B = " + std::to_string(H * B) + " is too large for the CPU handlers");
    return v.result();
  }
  // The packed layout's contents: everything the loops index with.
  const auto* rp = static_cast<const int32_t*>(c.row_ptr.data);
  const auto* col = static_cast<const int32_t*>(c.col_idx.data);
  if (rp[0] != 0 || rp[G * H] != nnz) {
    v.fail("row_ptr must start at 0 and end at nnz = " + std::to_string(nnz) + ", got " +
           std::to_string(rp[0]) + " .. " + std::to_string(rp[G * H]));
    return v.result();
  }
  for (int64_t r = 0; r < G * H; ++r) {
    if (rp[r + 1] < rp[r]) {
      v.fail("row_ptr decreases at packed row " + std::to_string(r));
      return v.result();
    }
  }
  for (int64_t k = 0; k < nnz; ++k) {
    if (col[k] < 0 || col[k] >= H) {
      v.fail("col_idx[" + std::to_string(k) + "] = " + std::to_string(col[k]) +
             " is out of range [0, " + std::to_string(H) + ")");
      return v.result();
    }
  }
  return v.result();
}

template <typename S>
Io<S> make_io(const Call& c) {
  auto in = [](const Arr& a) { return a.present ? static_cast<const S*>(a.data) : nullptr; };
  auto out = [](const Arr& a) { return a.present ? static_cast<S*>(a.data) : nullptr; };
  Io<S> io;
  io.xp = in(c.xp);
  io.lengths = static_cast<const int32_t*>(c.lengths.data);
  io.values = in(c.values);
  io.col_idx = static_cast<const int32_t*>(c.col_idx.data);
  io.row_ptr = static_cast<const int32_t*>(c.row_ptr.data);
  io.c0 = in(c.c0);
  io.h0 = in(c.h0);
  io.b_hn = in(c.b_hn);
  io.ys_out = out(c.ys_out);
  io.cs_out = out(c.cs_out);
  io.hT = out(c.hT);
  io.cT = out(c.cT);
  io.ys = in(c.ys);
  io.cs = in(c.cs);
  io.dys = in(c.dys);
  io.dcT = in(c.dcT);
  io.dhT = in(c.dhT);
  io.dxp = out(c.dxp);
  io.dvalues = out(c.dvalues);
  io.dc0 = out(c.dc0);
  io.dh0 = out(c.dh0);
  io.db_hn = out(c.db_hn);
  return io;
}

template <typename S, Cell kCell>
void run(bool backward, const Dims& d, const Io<S>& io, bool reverse, int64_t groups) {
  if (backward) {
    run_backward<S, kCell>(d, io, reverse, groups);
  } else {
    run_forward<S, kCell>(d, io, reverse);
  }
}

template <typename S>
void run_cell(Cell cell, bool backward, const Dims& d, const Call& c, bool reverse,
              int64_t groups) {
  const Io<S> io = make_io<S>(c);
  switch (cell) {
    case Cell::kRnnTanh: return run<S, Cell::kRnnTanh>(backward, d, io, reverse, groups);
    case Cell::kRnnRelu: return run<S, Cell::kRnnRelu>(backward, d, io, reverse, groups);
    case Cell::kLstm: return run<S, Cell::kLstm>(backward, d, io, reverse, groups);
    case Cell::kGru: return run<S, Cell::kGru>(backward, d, io, reverse, groups);
  }
}

// Validates, then runs the recurrence in the call's dtype.
ffi::Error execute(const char* target, Cell cell, bool backward, const Call& c, bool reverse,
                   int64_t groups) {
  Dims d;
  if (ffi::Error err = validate(target, cell, c, groups, d); err.failure()) return err;
  try {
    switch (c.xp.dtype) {
      case ffi::DataType::F32: run_cell<float>(cell, backward, d, c, reverse, groups); break;
      case ffi::DataType::BF16: run_cell<bf16>(cell, backward, d, c, reverse, groups); break;
      case ffi::DataType::F16: run_cell<f16>(cell, backward, d, c, reverse, groups); break;
      default: return ffi::Error::InvalidArgument(std::string(target) + ": unsupported dtype");
    }
  } catch (const std::bad_alloc&) {
    return ffi::Error::Internal(std::string(target) + ": out of host memory for the buffers");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(target) + ": " + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error rnn_cell(const char* target, int64_t activation, Cell& cell) {
  if (activation == 0) {
    cell = Cell::kRnnTanh;
  } else if (activation == 1) {
    cell = Cell::kRnnRelu;
  } else {
    return ffi::Error::InvalidArgument(std::string(target) + ": activation must be 0 (tanh) or "
                                       "1 (relu), got " + std::to_string(activation));
  }
  return ffi::Error::Success();
}

// ---- the six handlers ----------------------------------------------------------------------

using Buf = ffi::AnyBuffer;
using I32 = ffi::Buffer<ffi::S32>;
using Out = ffi::Result<ffi::AnyBuffer>;

ffi::Error RnnFwd(Buf xp, I32 lengths, Buf values, I32 col_idx, I32 row_ptr, Buf h0, Out ys,
                  Out hT, bool reverse, int64_t activation, int64_t /*variant*/) {
  constexpr const char* kName = "sprnn_rnn_fwd";
  Cell cell;
  if (ffi::Error err = rnn_cell(kName, activation, cell); err.failure()) return err;
  Call c;
  c.xp = arr("xp", xp);
  c.lengths = arr("lengths", lengths);
  c.values = arr("values", values);
  c.col_idx = arr("col_idx", col_idx);
  c.row_ptr = arr("row_ptr", row_ptr);
  c.h0 = arr("h0", h0);
  c.ys_out = arr("ys", *ys);
  c.hT = arr("hT", *hT);
  return execute(kName, cell, false, c, reverse, 1);
}

ffi::Error LstmFwd(Buf xp, I32 lengths, Buf values, I32 col_idx, I32 row_ptr, Buf c0, Buf h0,
                   Out ys, Out cT, Out hT, Out cs, bool reverse, int64_t /*variant*/) {
  Call c;
  c.xp = arr("xp", xp);
  c.lengths = arr("lengths", lengths);
  c.values = arr("values", values);
  c.col_idx = arr("col_idx", col_idx);
  c.row_ptr = arr("row_ptr", row_ptr);
  c.c0 = arr("c0", c0);
  c.h0 = arr("h0", h0);
  c.ys_out = arr("ys", *ys);
  c.cT = arr("cT", *cT);
  c.hT = arr("hT", *hT);
  c.cs_out = arr("cs", *cs);
  return execute("sprnn_lstm_fwd", Cell::kLstm, false, c, reverse, 1);
}

ffi::Error GruFwd(Buf xp, I32 lengths, Buf values, I32 col_idx, I32 row_ptr, Buf h0, Buf b_hn,
                  Out ys, Out hT, bool reverse, int64_t /*variant*/) {
  Call c;
  c.xp = arr("xp", xp);
  c.lengths = arr("lengths", lengths);
  c.values = arr("values", values);
  c.col_idx = arr("col_idx", col_idx);
  c.row_ptr = arr("row_ptr", row_ptr);
  c.h0 = arr("h0", h0);
  c.b_hn = arr("b_hn", b_hn);
  c.ys_out = arr("ys", *ys);
  c.hT = arr("hT", *hT);
  return execute("sprnn_gru_fwd", Cell::kGru, false, c, reverse, 1);
}

ffi::Error RnnBwd(Buf xp, I32 lengths, Buf values, I32 col_idx, I32 row_ptr, Buf h0, Buf ys,
                  Buf dys, Buf dhT, Out dxp, Out dvalues, Out dh0, bool reverse,
                  int64_t activation, int64_t groups) {
  constexpr const char* kName = "sprnn_rnn_bwd";
  Cell cell;
  if (ffi::Error err = rnn_cell(kName, activation, cell); err.failure()) return err;
  Call c;
  c.xp = arr("xp", xp);
  c.lengths = arr("lengths", lengths);
  c.values = arr("values", values);
  c.col_idx = arr("col_idx", col_idx);
  c.row_ptr = arr("row_ptr", row_ptr);
  c.h0 = arr("h0", h0);
  c.ys = arr("ys", ys);
  c.dys = arr("dys", dys);
  c.dhT = arr("dhT", dhT);
  c.dxp = arr("dxp", *dxp);
  c.dvalues = arr("dvalues", *dvalues);
  c.dh0 = arr("dh0", *dh0);
  return execute(kName, cell, true, c, reverse, groups);
}

ffi::Error LstmBwd(Buf xp, I32 lengths, Buf values, I32 col_idx, I32 row_ptr, Buf c0, Buf h0,
                   Buf ys, Buf cs, Buf dys, Buf dcT, Buf dhT, Out dxp, Out dvalues, Out dc0,
                   Out dh0, bool reverse, int64_t groups) {
  Call c;
  c.xp = arr("xp", xp);
  c.lengths = arr("lengths", lengths);
  c.values = arr("values", values);
  c.col_idx = arr("col_idx", col_idx);
  c.row_ptr = arr("row_ptr", row_ptr);
  c.c0 = arr("c0", c0);
  c.h0 = arr("h0", h0);
  c.ys = arr("ys", ys);
  c.cs = arr("cs", cs);
  c.dys = arr("dys", dys);
  c.dcT = arr("dcT", dcT);
  c.dhT = arr("dhT", dhT);
  c.dxp = arr("dxp", *dxp);
  c.dvalues = arr("dvalues", *dvalues);
  c.dc0 = arr("dc0", *dc0);
  c.dh0 = arr("dh0", *dh0);
  return execute("sprnn_lstm_bwd", Cell::kLstm, true, c, reverse, groups);
}

ffi::Error GruBwd(Buf xp, I32 lengths, Buf values, I32 col_idx, I32 row_ptr, Buf h0, Buf b_hn,
                  Buf ys, Buf dys, Buf dhT, Out dxp, Out dvalues, Out dh0, Out db_hn,
                  bool reverse, int64_t groups) {
  Call c;
  c.xp = arr("xp", xp);
  c.lengths = arr("lengths", lengths);
  c.values = arr("values", values);
  c.col_idx = arr("col_idx", col_idx);
  c.row_ptr = arr("row_ptr", row_ptr);
  c.h0 = arr("h0", h0);
  c.b_hn = arr("b_hn", b_hn);
  c.ys = arr("ys", ys);
  c.dys = arr("dys", dys);
  c.dhT = arr("dhT", dhT);
  c.dxp = arr("dxp", *dxp);
  c.dvalues = arr("dvalues", *dvalues);
  c.dh0 = arr("dh0", *dh0);
  c.db_hn = arr("db_hn", *db_hn);
  return execute("sprnn_gru_bwd", Cell::kGru, true, c, reverse, groups);
}

// The common argument prefix: xp, lengths, values, col_idx, row_ptr.
auto bind_prefix() {
  return ffi::Ffi::Bind().Arg<Buf>().Arg<I32>().Arg<Buf>().Arg<I32>().Arg<I32>();
}

}  // namespace
}  // namespace sprnn::cpu

using namespace sprnn::cpu;  // NOLINT: the handler symbols below live at global scope

XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnRnnFwd, RnnFwd,
                              bind_prefix()
                                  .Arg<Buf>()  // h0
                                  .Ret<Buf>()  // ys
                                  .Ret<Buf>()  // hT
                                  .Attr<bool>("reverse")
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("variant"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnLstmFwd, LstmFwd,
                              bind_prefix()
                                  .Arg<Buf>()  // c0
                                  .Arg<Buf>()  // h0
                                  .Ret<Buf>()  // ys
                                  .Ret<Buf>()  // cT
                                  .Ret<Buf>()  // hT
                                  .Ret<Buf>()  // cs
                                  .Attr<bool>("reverse")
                                  .Attr<int64_t>("variant"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnGruFwd, GruFwd,
                              bind_prefix()
                                  .Arg<Buf>()  // h0
                                  .Arg<Buf>()  // b_hn
                                  .Ret<Buf>()  // ys
                                  .Ret<Buf>()  // hT
                                  .Attr<bool>("reverse")
                                  .Attr<int64_t>("variant"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnRnnBwd, RnnBwd,
                              bind_prefix()
                                  .Arg<Buf>()  // h0
                                  .Arg<Buf>()  // ys
                                  .Arg<Buf>()  // dys
                                  .Arg<Buf>()  // dhT
                                  .Ret<Buf>()  // dxp
                                  .Ret<Buf>()  // dvalues
                                  .Ret<Buf>()  // dh0
                                  .Attr<bool>("reverse")
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("groups"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnLstmBwd, LstmBwd,
                              bind_prefix()
                                  .Arg<Buf>()  // c0
                                  .Arg<Buf>()  // h0
                                  .Arg<Buf>()  // ys
                                  .Arg<Buf>()  // cs
                                  .Arg<Buf>()  // dys
                                  .Arg<Buf>()  // dcT
                                  .Arg<Buf>()  // dhT
                                  .Ret<Buf>()  // dxp
                                  .Ret<Buf>()  // dvalues
                                  .Ret<Buf>()  // dc0
                                  .Ret<Buf>()  // dh0
                                  .Attr<bool>("reverse")
                                  .Attr<int64_t>("groups"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnGruBwd, GruBwd,
                              bind_prefix()
                                  .Arg<Buf>()  // h0
                                  .Arg<Buf>()  // b_hn
                                  .Arg<Buf>()  // ys
                                  .Arg<Buf>()  // dys
                                  .Arg<Buf>()  // dhT
                                  .Ret<Buf>()  // dxp
                                  .Ret<Buf>()  // dvalues
                                  .Ret<Buf>()  // dh0
                                  .Ret<Buf>()  // db_hn
                                  .Attr<bool>("reverse")
                                  .Attr<int64_t>("groups"));

namespace py = pybind11;

PYBIND11_MODULE(_sprnn_cpu, m) {
  m.doc() = "jax_sprnn CPU XLA FFI handlers (see docs/INTERFACE.md)";
  m.def(
      "registrations",
      []() {
        py::dict d;
        auto add = [&d](const char* name, XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
          d[name] = py::capsule(reinterpret_cast<void*>(fn));
        };
        add("sprnn_rnn_fwd", SprnnRnnFwd);
        add("sprnn_lstm_fwd", SprnnLstmFwd);
        add("sprnn_gru_fwd", SprnnGruFwd);
        add("sprnn_rnn_bwd", SprnnRnnBwd);
        add("sprnn_lstm_bwd", SprnnLstmBwd);
        add("sprnn_gru_bwd", SprnnGruBwd);
        return d;
      },
      "Dict {FFI target name: PyCapsule of the handler} for the cpu platform.");
}
