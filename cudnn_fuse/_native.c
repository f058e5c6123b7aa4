/* cudnn_fuse._native: the memoized op call in C (ops._memo + ops._Launch + Plan.launch's replay).
 *
 * Why C: a memoized cf.linear spends most of its host time in Python around two unavoidable
 * costs, torch's allocation of the output and the driver's kernel launch (docs/decisions.md,
 * "The eager call's host time"). This module does the same steps with the same objects, so the
 * two paths cannot disagree:
 *
 *   call(name, grad_name, a, b, c, d, attrs)  ops._memo's checks and key, looked up in ops._FAST;
 *                                             a hit is called with (a, b, c, d), a miss returns
 *                                             None and the Python path runs as before. The caller
 *                                             has checked torch.compiler.is_compiling() (in Python,
 *                                             where dynamo reads it) and autocast.
 *   Launch(...)                               ops._Launch: allocate the output (and amax), read
 *                                             the operands' pointers, launch the plan.
 *   KernelLaunch                              the base of launch_graphs.KernelReplay: its kernel
 *                                             launched by cuLaunchKernelEx from C.
 *
 * Every module-level name is read from the Python modules' dicts on each call (ops, plans,
 * launch_graphs), exactly as the Python functions read their globals, so switches
 * (set_launch_graphs), monkeypatched stand-ins and cleared memos behave the same on both paths.
 * Anything this path does not handle (a capture, a sighting, a failed launch, torch's own
 * capture, another device, a graph replay or node sequence) goes to the plan's Python launch.
 *
 * No torch headers: only the CPython API and one function pointer (cuLaunchKernelEx, taken from
 * the ctypes binding launch_graphs already made), so it builds wherever a C compiler is, and an
 * install without one keeps the Python path (the extension is optional in setup.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*launch_fn_t)(void *cfg, void *func, void *params, void *extra);

#define CFG_MAX 256 /* CUlaunchConfig is 56 bytes on 64-bit hosts; room to spare */

/* configure()'s objects (strong references, set once at import of cudnn_fuse.ops) */
static PyObject *ops_dict, *plans_dict, *lg_dict; /* module __dict__s */
static PyTypeObject *tensor_type;                  /* torch.Tensor (exact type, as ops._memo checks) */
static PyTypeObject *parameter_type;               /* torch.nn.Parameter */
static PyObject *torch_empty_strided, *torch_empty, *float32, *empty_tuple, *alloc_kwnames, *zero, *one;
/* torch's own compiled helpers, where this torch has them (torch._C._dynamo.guards, what Inductor's generated
   code calls; NULL / None otherwise, and the Python getters serve):
   - TensorGuards(*tensors).check(*tensors): dtype, device, dispatch keys, requires_grad, sizes and strides of
     tensors against the ones it was made from, in C++ (what dynamo guards compiled frames with);
   - _torchinductor_pyobject_tensor_data_ptr: a tensor's data pointer, a C function (its address). */
static PyObject *tensor_guards, *guard_kwargs, *index_mark;
typedef void *(*data_ptr_fn_t)(PyObject *);
static data_ptr_fn_t data_ptr_fn;
#define GUARDS_PER_KEY 8

/* interned names */
static PyObject *s_active_recorders, *s_functorch_on, *s_grad_enabled, *s_det_algorithms,
    *s_det_cudnn, *s_FAST, *s_current_stream, *s_capturing, *s_current_device, *s_workspace_ptr, *s_ENABLED,
    *s_STATS, *s_alloc_cuda, *s_alloc_cpu, *s_FAST_CAPACITY, *s_check, *s_type, *s_cuda, *s_cpu, *s_shape, *s_stride, *s_dtype, *s_device, *s_requires_grad, *s_data_ptr, *s_is_neg, *s_new_empty_strided,
    *s_launch, *s_execs, *s_off, *s_reuses, *s_replays;

static unsigned long long n_fast, n_slow; /* launches served here / handed to the plan's Python launch */
static unsigned long long n_guarded, n_keyed; /* memo hits through a guard / through the exact key */

/* cuStreamIsCapturing, where set_driver gave it: the capture test of a stream without torch's Python call
   (plans._capturing, torch._C._cuda_isCurrentStreamCapturing, asks the same of the same stream) */
typedef int (*capturing_fn_t)(void *stream, int *status);
static capturing_fn_t stream_capturing;

static PyObject *
global(PyObject *dict, PyObject *name) /* borrowed; NULL with an exception when missing */
{
    PyObject *v = PyDict_GetItemWithError(dict, name);
    if (v == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_AttributeError, "cudnn_fuse._native: module global %U is missing", name);
    return v;
}

static int
call_truth(PyObject *dict, PyObject *name) /* bool(dict[name]()); -1 on error */
{
    PyObject *f = global(dict, name), *r;
    int t;
    if (f == NULL)
        return -1;
    r = PyObject_CallNoArgs(f);
    if (r == NULL)
        return -1;
    t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* ------------------------------------------------------------------------- KernelLaunch */

typedef struct {
    PyObject_HEAD
    launch_fn_t fn; /* NULL: not bound (a stand-in launch that is no C function): the Python launch serves */
    char *cfg;      /* the subclass's ctypes CUlaunchConfig, alive as long as the object */
    Py_ssize_t cfg_size, stream_off;
    void *func, *params, *extra;
} KernelLaunch;

static int
kl_launch(KernelLaunch *k, unsigned long long stream)
{
    /* a copy per launch: the shared config is never written here, so a launch on this path and one
       on the Python path (which sets hStream, then releases the GIL in ctypes) cannot race */
    _Alignas(16) char cfg[CFG_MAX]; /* read by the driver as its CUlaunchConfig */
    void *s = (void *)(uintptr_t)stream;
    memcpy(cfg, k->cfg, (size_t)k->cfg_size);
    memcpy(cfg + k->stream_off, &s, sizeof s);
    return k->fn(cfg, k->func, k->params, k->extra);
}

static PyObject *
KernelLaunch_bind(KernelLaunch *self, PyObject *args)
{
    unsigned long long fn, cfg, func, params, extra;
    Py_ssize_t size, off;
    if (!PyArg_ParseTuple(args, "KKnnKKK:_bind", &fn, &cfg, &size, &off, &func, &params, &extra))
        return NULL;
    if (size <= 0 || size > CFG_MAX || off < 0 || off > size - (Py_ssize_t)sizeof(void *)) {
        PyErr_Format(PyExc_ValueError, "_bind: launch config of %zd bytes with its stream at %zd", size, off);
        return NULL;
    }
    if (fn == 0 || cfg == 0) {
        PyErr_SetString(PyExc_ValueError, "_bind: the launch function and the config need addresses");
        return NULL;
    }
    self->fn = (launch_fn_t)(uintptr_t)fn;
    self->cfg = (char *)(uintptr_t)cfg;
    self->cfg_size = size;
    self->stream_off = off;
    self->func = (void *)(uintptr_t)func;
    self->params = (void *)(uintptr_t)params;
    self->extra = (void *)(uintptr_t)extra;
    Py_RETURN_NONE;
}

static PyObject *
KernelLaunch_native_launch(KernelLaunch *self, PyObject *arg)
{
    unsigned long long stream = PyLong_AsUnsignedLongLong(arg);
    if (stream == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (self->fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "native_launch: not bound");
        return NULL;
    }
    return PyLong_FromLong(kl_launch(self, stream));
}

static PyObject *
KernelLaunch_bound(KernelLaunch *self, void *closure)
{
    return PyBool_FromLong(self->fn != NULL);
}

static PyMethodDef KernelLaunch_methods[] = {
    {"_bind", (PyCFunction)KernelLaunch_bind, METH_VARARGS,
     "_bind(fn, cfg, cfg_size, stream_offset, func, params, extra): addresses of cuLaunchKernelEx, of the "
     "CUlaunchConfig (kept alive by the caller), the config's size and hStream's offset, and the kernel's "
     "function, parameter array and extra buffer (0 for none)."},
    {"native_launch", (PyCFunction)KernelLaunch_native_launch, METH_O,
     "native_launch(stream) -> CUresult: the kernel launched from C on stream (a copy of the config)."},
    {NULL}};

static PyGetSetDef KernelLaunch_getset[] = {
    {"native_bound", (getter)KernelLaunch_bound, NULL, "whether _bind gave this launch a C function", NULL},
    {NULL}};

static PyTypeObject KernelLaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cudnn_fuse._native.KernelLaunch",
    .tp_basicsize = sizeof(KernelLaunch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A captured kernel's launch from C (the base of launch_graphs.KernelReplay).",
    .tp_new = PyType_GenericNew,
    .tp_methods = KernelLaunch_methods,
    .tp_getset = KernelLaunch_getset,
};

/* ------------------------------------------------------------------------------- Launch */

typedef struct {
    PyObject_HEAD
    PyObject *plan, *size, *stride, *dtype, *device, *graphs, *dev_obj, *ws_obj;
    int amax, like_a, kind; /* kind: the output's device, 1 CUDA, 2 CPU, 0 another */
    long dev_index;         /* the output's device index (-1 for none); a plan's launches run on it */
    Py_ssize_t ws_size;
} Launch;

static int
Launch_traverse(Launch *self, visitproc visit, void *arg)
{
    Py_VISIT(self->plan);
    Py_VISIT(self->size);
    Py_VISIT(self->stride);
    Py_VISIT(self->dtype);
    Py_VISIT(self->device);
    Py_VISIT(self->graphs);
    Py_VISIT(self->dev_obj);
    Py_VISIT(self->ws_obj);
    return 0;
}

static int
Launch_clear(Launch *self)
{
    Py_CLEAR(self->plan);
    Py_CLEAR(self->size);
    Py_CLEAR(self->stride);
    Py_CLEAR(self->dtype);
    Py_CLEAR(self->device);
    Py_CLEAR(self->graphs);
    Py_CLEAR(self->dev_obj);
    Py_CLEAR(self->ws_obj);
    return 0;
}

static void
Launch_dealloc(Launch *self)
{
    PyObject_GC_UnTrack(self);
    Launch_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Launch_init(Launch *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"plan", "size", "stride", "dtype", "device", "amax", "like_a", "graphs", "device_index",
                         "workspace_size", NULL};
    PyObject *plan, *size, *stride, *dtype, *device, *graphs = Py_None;
    int amax, like_a;
    long dev_index = -1;
    Py_ssize_t ws = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!OOpp|Oln:Launch", kw, &plan, &PyTuple_Type, &size,
                                     &PyTuple_Type, &stride, &dtype, &device, &amax, &like_a, &graphs, &dev_index,
                                     &ws))
        return -1;
    if (ws < 0) {
        PyErr_Format(PyExc_ValueError, "Launch: workspace_size must be >= 0, got %zd", ws);
        return -1;
    }
    if (self->plan != NULL) { /* a live Launch's fields are read by calls that the old plan's __del__ could make */
        PyErr_SetString(PyExc_TypeError, "Launch: already initialised (make a new one)");
        return -1;
    }
    Launch_clear(self);
    Py_INCREF(plan);
    self->plan = plan;
    Py_INCREF(size);
    self->size = size;
    Py_INCREF(stride);
    self->stride = stride;
    Py_INCREF(dtype);
    self->dtype = dtype;
    Py_INCREF(device);
    self->device = device;
    Py_INCREF(graphs);
    self->graphs = graphs;
    self->amax = amax;
    self->like_a = like_a;
    self->dev_index = dev_index;
    self->ws_size = ws;
    self->dev_obj = PyLong_FromLong(dev_index);
    self->ws_obj = PyLong_FromSsize_t(ws);
    if (self->dev_obj == NULL || self->ws_obj == NULL)
        return -1;
    {
        PyObject *t = PyObject_GetAttr(device, s_type);
        if (t == NULL) {
            PyErr_Clear(); /* not a torch.device: allocations take the generic calls */
            self->kind = 0;
        } else {
            int cuda = PyUnicode_Check(t) && PyUnicode_Compare(t, s_cuda) == 0;
            int cpu = PyUnicode_Check(t) && PyUnicode_Compare(t, s_cpu) == 0;
            Py_DECREF(t);
            if (PyErr_Occurred())
                PyErr_Clear();
            self->kind = cuda ? 1 : cpu ? 2 : 0;
        }
    }
    return 0;
}

static PyObject *
data_ptr(PyObject *t) /* t.data_ptr(), a new reference */
{
    PyObject *argv[1] = {t};
    return PyObject_VectorcallMethod(s_data_ptr, argv, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

#define ALIGNMENT 16 /* ops.ALIGNMENT: the operand alignment the graphs declare */

static PyObject *
tensor_ptr(PyObject *t, int guarded) /* t's data pointer as an int, a new reference */
{
    /* torch's C function only for tensors that passed a TensorGuards check against operands that launched
       before (the same dispatch keys, dtype, sizes and strides: dense, with storage) and are torch's own
       types: it throws a C++ exception for anything without storage, which no C caller may meet */
    if (guarded && data_ptr_fn != NULL && (Py_TYPE(t) == tensor_type || Py_TYPE(t) == parameter_type))
        return PyLong_FromVoidPtr(data_ptr_fn(t));
    return data_ptr(t);
}

static int
bump(PyObject *obj, PyObject *name) /* obj.name += 1 */
{
    PyObject *v = PyObject_GetAttr(obj, name), *w;
    int rc;
    if (v == NULL)
        return -1;
    w = PyNumber_Add(v, one);
    Py_DECREF(v);
    if (w == NULL)
        return -1;
    rc = PyObject_SetAttr(obj, name, w);
    Py_DECREF(w);
    return rc;
}

/* The plan's replay launched from here, when every condition of Plan.launch's replay holds and the
   pointer set's capture is a bound KernelLaunch: 1 launched, 0 not served (nothing launched), -1 error. */
static int
fast_replay(Launch *L, PyObject **ptrs, Py_ssize_t n, long cur)
{
    PyObject *f, *r = NULL, *stream_obj = NULL, *ws_obj = NULL, *keep = NULL, *key = NULL, *execs = NULL, *ex;
    unsigned long long stream;
    int t, result = -1;
    Py_ssize_t i;

    if (!(f = global(plans_dict, s_current_stream)) || !(stream_obj = PyObject_CallOneArg(f, L->dev_obj)))
        goto out;
    stream = PyLong_AsUnsignedLongLong(stream_obj);
    if (stream == (unsigned long long)-1 && PyErr_Occurred())
        goto out;
    if (stream != 0) { /* the legacy default stream (0) is never captured */
        int status = 0;
        if (stream_capturing != NULL && stream_capturing((void *)(uintptr_t)stream, &status) == 0)
            t = status != 0; /* CU_STREAM_CAPTURE_STATUS_ACTIVE or _INVALIDATED: capturing, as torch counts it */
        else
            t = call_truth(plans_dict, s_capturing);
        if (t != 0) {
            result = t < 0 ? -1 : 0; /* torch captures: the plan's own launch joins torch's graph */
            goto out;
        }
    }
    if (L->ws_size) {
        PyObject *argv[4] = {L->dev_obj, stream_obj, L->ws_obj, Py_False};
        if (!(f = global(plans_dict, s_workspace_ptr)) || !(r = PyObject_Vectorcall(f, argv, 4, NULL)))
            goto out;
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
            PyErr_SetString(PyExc_TypeError, "plans._workspace_ptr must return (pointer, keep-alive)");
            goto out;
        }
        ws_obj = PyTuple_GET_ITEM(r, 0);
        keep = PyTuple_GET_ITEM(r, 1);
        Py_INCREF(ws_obj);
        Py_INCREF(keep);
        Py_CLEAR(r);
    } else {
        ws_obj = zero;
        Py_INCREF(ws_obj);
    }
    /* graphs.off, launch_graphs.ENABLED, the current device: as Plan.launch tests them */
    if (!(r = PyObject_GetAttr(L->graphs, s_off)) || (t = PyObject_IsTrue(r)) < 0)
        goto out;
    Py_CLEAR(r);
    if (t) {
        result = 0;
        goto out;
    }
    if (!(f = global(lg_dict, s_ENABLED)) || (t = PyObject_IsTrue(f)) < 0)
        goto out;
    if (!t) {
        result = 0;
        goto out;
    }
    if (cur != L->dev_index) {
        result = 0;
        goto out;
    }
    if (!(key = PyTuple_New(n + 1)))
        goto out;
    Py_INCREF(ws_obj);
    PyTuple_SET_ITEM(key, 0, ws_obj);
    for (i = 0; i < n; i++) {
        Py_INCREF(ptrs[i]);
        PyTuple_SET_ITEM(key, i + 1, ptrs[i]);
    }
    if (!(execs = PyObject_GetAttr(L->graphs, s_execs))) /* read each call: release() swaps the dict */
        goto out;
    ex = PyDict_Check(execs) ? PyDict_GetItemWithError(execs, key) : NULL;
    if (ex == NULL || !PyObject_TypeCheck(ex, &KernelLaunchType) || ((KernelLaunch *)ex)->fn == NULL) {
        /* not captured yet (the plan's launch sights or captures it), or a graph executable or a node
           sequence (the plan's launch replays it) */
        result = PyErr_Occurred() ? -1 : 0;
        goto out;
    }
    Py_INCREF(ex);
    t = kl_launch((KernelLaunch *)ex, stream);
    Py_DECREF(ex);
    if (t != 0) {
        result = 0; /* nothing launched: the plan's launch tries again, and fails over to raw */
        goto out;
    }
    {
        PyObject *stats = global(lg_dict, s_STATS);
        int bad;
        Py_XINCREF(stats); /* held across the first bump, which may run Python */
        bad = stats == NULL || bump(L->graphs, s_reuses) < 0 || bump(stats, s_replays) < 0;
        Py_XDECREF(stats);
        if (bad)
            goto out; /* launched, but the counters failed: an error (never launched twice) */
    }
    result = 1;
out:
    Py_XDECREF(r);
    Py_XDECREF(execs);
    Py_XDECREF(key);
    Py_XDECREF(keep);
    Py_XDECREF(ws_obj);
    Py_XDECREF(stream_obj);
    return result;
}

static int
plan_launch(Launch *L, PyObject **ptrs, Py_ssize_t n, long cur)
{
    PyObject *list, *r;
    Py_ssize_t i;
    if (L->graphs != Py_None) {
        int served = fast_replay(L, ptrs, n, cur);
        if (served != 0) {
            n_fast += served > 0;
            return served > 0 ? 0 : -1;
        }
    }
    n_slow++;
    if (!(list = PyList_New(n)))
        return -1;
    for (i = 0; i < n; i++) {
        Py_INCREF(ptrs[i]);
        PyList_SET_ITEM(list, i, ptrs[i]);
    }
    r = PyObject_CallMethodOneArg(L->plan, s_launch, list);
    Py_DECREF(list);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static long
current_device(void) /* plans._current_device(), or -2 with an exception */
{
    PyObject *f = global(plans_dict, s_current_device), *r;
    long cur;
    if (f == NULL || !(r = PyObject_CallNoArgs(f)))
        return -2;
    cur = PyLong_AsLong(r);
    Py_DECREF(r);
    return cur == -1 && PyErr_Occurred() ? -2 : cur;
}

/* torch's allocation helper for this output's device, borrowed, or NULL: _empty_strided_cuda allocates on
   the current device, so it serves only where that is the output's */
static PyObject *
fast_alloc(Launch *L, long cur)
{
    PyObject *f;
    if (L->kind == 1 && cur == L->dev_index)
        f = PyDict_GetItemWithError(ops_dict, s_alloc_cuda);
    else if (L->kind == 2)
        f = PyDict_GetItemWithError(ops_dict, s_alloc_cpu);
    else
        return NULL;
    return f == Py_None ? NULL : f;
}

static PyObject *
alloc(Launch *L, PyObject *a, PyObject *size, PyObject *stride, PyObject *dtype, long cur, int is_y)
{
    PyObject *f = fast_alloc(L, cur);
    if (f != NULL) {
        PyObject *argv[3] = {size, stride, dtype};
        return PyObject_Vectorcall(f, argv, 3, NULL);
    }
    if (PyErr_Occurred())
        return NULL;
    if (L->like_a && is_y) {
        PyObject *argv[3] = {a, size, stride};
        return PyObject_VectorcallMethod(s_new_empty_strided, argv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    } else {
        PyObject *argv[4] = {size, stride, dtype, L->device};
        return PyObject_Vectorcall(torch_empty_strided, argv, 2, alloc_kwnames);
    }
}

static PyObject *
launch_call(Launch *L, PyObject *a, PyObject *b, PyObject *c, PyObject *d, int guarded)
{
    PyObject *y = NULL, *am = NULL, *ptrs[7], *ins[4] = {a, b, c, d}, *out = NULL;
    Py_ssize_t n = 0, i;
    long cur = -1;
    unsigned long long p;

    if (L->ws_obj == NULL || L->dev_obj == NULL) { /* never initialised (Launch.__new__), or its __init__ failed part-way */
        PyErr_SetString(PyExc_RuntimeError, "Launch: not initialised");
        return NULL;
    }
    if ((L->kind == 1 || L->graphs != Py_None) && (cur = current_device()) == -2)
        return NULL; /* the current device: where torch's helper allocates, and a replay's condition */
    if (!(y = alloc(L, a, L->size, L->stride, L->dtype, cur, 1)))
        return NULL;
    for (i = 0; i < 4; i++) {
        if (ins[i] == Py_None)
            continue;
        if (!(ptrs[n] = tensor_ptr(ins[i], guarded)))
            goto done;
        n++;
        p = PyLong_AsUnsignedLongLongMask(ptrs[n - 1]);
        if (p == (unsigned long long)-1 && PyErr_Occurred())
            goto done; /* a data_ptr() that is no int (a subclass's): its error, not a pointer */
        if (p % ALIGNMENT) { /* ops._misaligned: the Python path falls back */
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
    }
    if (!(ptrs[n] = tensor_ptr(y, guarded)))
        goto done;
    n++;
    if (L->amax) {
        if (!(am = alloc(L, a, empty_tuple, empty_tuple, float32, cur, 0)))
            goto done;
        if (!(ptrs[n] = tensor_ptr(am, guarded)))
            goto done;
        n++;
    }
    if (plan_launch(L, ptrs, n, cur) < 0)
        goto done;
    if (am != NULL)
        out = PyTuple_Pack(2, y, am);
    else {
        out = y;
        Py_INCREF(out);
    }
done:
    for (i = 0; i < n; i++)
        Py_DECREF(ptrs[i]);
    Py_XDECREF(am);
    Py_DECREF(y);
    return out;
}

static PyObject *
Launch_call(Launch *self, PyObject *args, PyObject *kwds)
{
    PyObject *a, *b, *c, *d;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Launch takes its four operands positionally");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "Launch", 4, 4, &a, &b, &c, &d))
        return NULL;
    return launch_call(self, a, b, c, d, 0);
}

static PyObject *
Launch_get_amax(Launch *self, void *closure)
{
    return PyBool_FromLong(self->amax);
}

static PyObject *
Launch_get_like_a(Launch *self, void *closure)
{
    return PyBool_FromLong(self->like_a);
}

static PyObject *
Launch_get(Launch *self, void *closure)
{
    PyObject *v = *(PyObject **)((char *)self + (Py_ssize_t)closure);
    if (v == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Launch: not initialised");
        return NULL;
    }
    Py_INCREF(v);
    return v;
}

#define FIELD(name, doc) {#name, (getter)Launch_get, NULL, doc, (void *)offsetof(Launch, name)}
static PyGetSetDef Launch_getset[] = {
    FIELD(plan, "the plan launched"),
    FIELD(size, "the output's size"),
    FIELD(stride, "the output's stride"),
    FIELD(dtype, "the output's dtype"),
    FIELD(device, "the output's device"),
    FIELD(graphs, "the plan's launch graphs (None: every launch goes to plan.launch)"),
    {"amax", (getter)Launch_get_amax, NULL, "whether an amax output follows y", NULL},
    {"like_a", (getter)Launch_get_like_a, NULL, "whether y is allocated as a.new_empty_strided", NULL},
    {NULL}};

static PyTypeObject LaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cudnn_fuse._native.Launch",
    .tp_basicsize = sizeof(Launch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A remembered signature (ops._Launch): called with the op's four operands (None where absent).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Launch_init,
    .tp_dealloc = (destructor)Launch_dealloc,
    .tp_traverse = (traverseproc)Launch_traverse,
    .tp_clear = (inquiry)Launch_clear,
    .tp_call = (ternaryfunc)Launch_call,
    .tp_getset = Launch_getset,
};

/* --------------------------------------------------------------------------- the memo */

static PyObject *
meta(PyObject *t) /* (t.shape, t.stride(), t.dtype, t.device), or None for None; NULL with an exception */
{
    PyObject *shape, *stride = NULL, *dtype = NULL, *device = NULL, *r = NULL, *argv[1] = {t};
    if (t == Py_None) {
        Py_INCREF(Py_None);
        return Py_None;
    }
    if (!(shape = PyObject_GetAttr(t, s_shape)))
        return NULL;
    if (!(stride = PyObject_VectorcallMethod(s_stride, argv, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)))
        goto done;
    if (!(dtype = PyObject_GetAttr(t, s_dtype)))
        goto done;
    if (!(device = PyObject_GetAttr(t, s_device)))
        goto done;
    r = PyTuple_Pack(4, shape, stride, dtype, device);
done:
    Py_DECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    return r;
}

static int
requires_grad(PyObject *t) /* getattr(t, "requires_grad", False) as a truth value; -1 on error */
{
    PyObject *v;
    int r;
    if (t == Py_None)
        return 0;
    if (!(v = PyObject_GetAttr(t, s_requires_grad))) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The attributes' exact types, the key's item beside their values (ops._attr_sig_py is the Python twin; the
   two must agree): True == 1 == 1.0 with one hash, so a key of values alone served groups=True (which
   validation refuses) from the entry of groups=1. A tuple of None, bool, int, float, str and flat tuples of
   those (every op's attributes) gives an int, 3 bits an item after a leading 1: one allocation, no tuple to
   hash; anything else (a numpy integer, a nested tuple, a long tuple) gives exact_types(attrs), which refuses a
   tensor attribute (TypeError: the call is not memoized). */
#define SIG_FULL (1ULL << 58) /* a code this large takes no further item */

static int
leaf_code(PyObject *v) /* an attribute's 3-bit code; 0 for a type without one (6 opens a tuple) */
{
    PyTypeObject *t = Py_TYPE(v);
    if (v == Py_None)
        return 1;
    if (t == &PyBool_Type)
        return 2;
    if (t == &PyLong_Type)
        return 3;
    if (t == &PyFloat_Type)
        return 4;
    if (t == &PyUnicode_Type)
        return 5;
    return 0;
}

static PyObject *
exact_types(PyObject *v) /* type(v); for an exact tuple, the tuple of its items' exact_types */
{
    PyObject *r;
    Py_ssize_t i, n;
    if (!PyTuple_CheckExact(v)) {
        if (tensor_type != NULL && PyObject_TypeCheck(v, tensor_type)) {
            /* a tensor attribute (stride=torch.tensor(2)) is keyed by its identity, and its value can change
               in place: unkeyable, as ops._exact_types says */
            PyErr_SetString(PyExc_TypeError, "a tensor attribute cannot key the memo (its value may change in place)");
            return NULL;
        }
        Py_INCREF(Py_TYPE(v));
        return (PyObject *)Py_TYPE(v);
    }
    if (Py_EnterRecursiveCall(" in cudnn_fuse._native.attr_sig"))
        return NULL;
    n = PyTuple_GET_SIZE(v);
    if ((r = PyTuple_New(n)) != NULL) {
        for (i = 0; i < n; i++) {
            PyObject *item = exact_types(PyTuple_GET_ITEM(v, i));
            if (item == NULL) {
                Py_CLEAR(r);
                break;
            }
            PyTuple_SET_ITEM(r, i, item);
        }
    }
    Py_LeaveRecursiveCall();
    return r;
}

/* The codes' ints, made once each (an int past 256 is an allocation, and every call makes a code): a
   direct-mapped cache, under the GIL */
#define SIG_CACHE 64
static unsigned long long sig_codes[SIG_CACHE];
static PyObject *sig_ints[SIG_CACHE];

static PyObject *
sig_int(unsigned long long code)
{
    unsigned i = (unsigned)((code ^ code >> 17 ^ code >> 31) % SIG_CACHE);
    PyObject *v;
    if (sig_ints[i] == NULL || sig_codes[i] != code) {
        if (!(v = PyLong_FromUnsignedLongLong(code)))
            return NULL;
        Py_XSETREF(sig_ints[i], v);
        sig_codes[i] = code;
    }
    Py_INCREF(sig_ints[i]);
    return sig_ints[i];
}

static PyObject *
attr_sig(PyObject *attrs) /* a new reference, or NULL with an exception */
{
    unsigned long long code = 1;
    Py_ssize_t i, j;
    int c;
    if (!PyTuple_CheckExact(attrs))
        return exact_types(attrs);
    for (i = 0; i < PyTuple_GET_SIZE(attrs); i++) {
        PyObject *v = PyTuple_GET_ITEM(attrs, i);
        if (PyTuple_CheckExact(v)) {
            if (code >= SIG_FULL)
                return exact_types(attrs);
            code = code << 3 | 6;
            for (j = 0; j < PyTuple_GET_SIZE(v); j++) {
                if (!(c = leaf_code(PyTuple_GET_ITEM(v, j))) || code >= SIG_FULL)
                    return exact_types(attrs);
                code = code << 3 | (unsigned)c;
            }
        } else {
            if (!(c = leaf_code(v)) || code >= SIG_FULL)
                return exact_types(attrs);
            code = code << 3 | (unsigned)c;
        }
    }
    return sig_int(code);
}

static PyObject *
native_attr_sig(PyObject *module, PyObject *attrs)
{
    return attr_sig(attrs);
}

/* ops._memo's key for these operands, given the grad mode, the attributes' signature (attr_sig) and the
   deterministic flag, or NULL with an exception where the arguments cannot be keyed */
static PyObject *
memo_key(PyObject *const *args, int grad_on, PyObject *sig, PyObject *det)
{
    PyObject *name = args[0], *m[4] = {NULL, NULL, NULL, NULL}, *key = NULL;
    int i, grad = 0;

    if (grad_on) {
        for (i = 2; i < 6 && !grad; i++) {
            if ((grad = requires_grad(args[i])) < 0)
                return NULL;
        }
    }
    if (grad)
        name = args[1];
    for (i = 0; i < 4; i++) {
        if (!(m[i] = meta(args[2 + i])))
            goto done;
    }
    key = PyTuple_Pack(8, name, m[0], m[1], m[2], m[3], args[6], sig, det);
done:
    for (i = 0; i < 4; i++)
        Py_XDECREF(m[i]);
    return key;
}

/* The guarded index: in ops._FAST too (so that whatever clears the memo clears it), under
   (index mark, name, which of b/c/d are present, attrs, attr_sig(attrs), deterministic, grad mode, a.shape) -> a list of
   (TensorGuards(...).check, entry), most recently registered first. An entry is registered the first time
   the exact key (memo_key) finds it; after that a call costs one C++ guard check instead of reading
   shape, stride, dtype and device of every operand in Python and hashing them. The guard checks each
   operand's type, dispatch keys, dtype, device index, requires_grad, sizes and strides against those the
   entry was found for: everything the exact key holds, and more (a miss there only takes the exact key). */
static PyObject *
index_key(PyObject *const *args, PyObject *sig, PyObject *det, int grad_on)
{
    PyObject *shape = PyObject_GetAttr(args[2], s_shape), *mask, *key;
    if (shape == NULL)
        return NULL;
    mask = PyLong_FromLong((args[3] != Py_None) | (args[4] != Py_None) << 1 | (args[5] != Py_None) << 2);
    if (mask == NULL) {
        Py_DECREF(shape);
        return NULL;
    }
    key = PyTuple_Pack(8, index_mark, args[0], mask, args[6], sig, det, grad_on ? Py_True : Py_False, shape);
    Py_DECREF(shape);
    Py_DECREF(mask);
    return key;
}

static PyObject *
present(PyObject *const *args) /* the operands a, b, c, d that are not None, as a tuple */
{
    PyObject *t;
    Py_ssize_t n = 0, i;
    for (i = 2; i < 6; i++)
        n += args[i] != Py_None;
    if (!(t = PyTuple_New(n)))
        return NULL;
    for (i = 2, n = 0; i < 6; i++) {
        if (args[i] != Py_None) {
            Py_INCREF(args[i]);
            PyTuple_SET_ITEM(t, n++, args[i]);
        }
    }
    return t;
}

static PyObject * /* the entry whose guard passes, a new reference (moved to its list's front), or NULL */
guarded_entry(PyObject *lst, PyObject *targs)
{
    Py_ssize_t i, j;
    for (i = 0; i < PyList_GET_SIZE(lst); i++) { /* a check may run Python (or let a thread in): re-read */
        PyObject *pair = PyList_GET_ITEM(lst, i), *r, *entry;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2)
            continue;
        Py_INCREF(pair);
        r = PyObject_Call(PyTuple_GET_ITEM(pair, 0), targs, NULL);
        if (r == NULL) {
            PyErr_Clear();
            Py_DECREF(pair);
            continue;
        }
        Py_DECREF(r);
        if (r != Py_True) {
            Py_DECREF(pair);
            continue;
        }
        entry = PyTuple_GET_ITEM(pair, 1);
        Py_INCREF(entry);
        for (j = 0; j < PyList_GET_SIZE(lst) && PyList_GET_ITEM(lst, j) != pair; j++)
            ;
        if (j > 0 && j < PyList_GET_SIZE(lst) &&
            (PyList_SetSlice(lst, j, j + 1, NULL) < 0 || PyList_Insert(lst, 0, pair) < 0))
            PyErr_Clear();
        Py_DECREF(pair);
        return entry;
    }
    return NULL;
}

static PyObject * /* the operands' guard, made now (no exception left set): NULL where none is made */
guard_make(PyObject *targs)
{
    PyObject *tg, *check;
    Py_ssize_t i, j, n = PyTuple_GET_SIZE(targs);
    for (i = 0; i < n; i++) /* TensorGuards refuses operands passed twice (aliasing): such calls keep the key */
        for (j = i + 1; j < n; j++)
            if (PyTuple_GET_ITEM(targs, i) == PyTuple_GET_ITEM(targs, j))
                return NULL;
    if (!(tg = PyObject_Call(tensor_guards, targs, guard_kwargs))) {
        PyErr_Clear();
        return NULL;
    }
    check = PyObject_GetAttr(tg, s_check);
    Py_DECREF(tg);
    if (!check)
        PyErr_Clear();
    return check;
}

static void /* best effort: leaves no exception set; check: guard_make's */
guard_register(PyObject *memo, PyObject *ikey, PyObject *entry, PyObject *check)
{
    PyObject *pair = NULL, *lst = NULL, *cap;
    cap = PyDict_GetItemWithError(plans_dict, s_FAST_CAPACITY);
    if (cap == NULL && PyErr_Occurred())
        goto out;
    if (cap != NULL && PyLong_Check(cap) && PyDict_GET_SIZE(memo) >= PyLong_AsSsize_t(cap))
        goto out; /* full: the Python path clears the memo when it next remembers */
    if (!(pair = PyTuple_Pack(2, check, entry)))
        goto out;
    lst = PyDict_GetItemWithError(memo, ikey);
    if (lst == NULL) {
        if (PyErr_Occurred() || !(lst = PyList_New(0)))
            goto out;
        if (PyDict_SetItem(memo, ikey, lst) < 0)
            goto out;
    } else {
        Py_INCREF(lst); /* dropping the list's last guard below may run code (an entry's plan freed) */
    }
    if (PyList_Check(lst) &&
        (PyList_GET_SIZE(lst) < GUARDS_PER_KEY || PyList_SetSlice(lst, GUARDS_PER_KEY - 1, PyList_GET_SIZE(lst), NULL) == 0))
        PyList_Insert(lst, 0, pair);
out:
    Py_XDECREF(lst);
    Py_XDECREF(pair);
    PyErr_Clear();
}

/* Whether an operand a, b, c, d is a negated view (t.is_neg()): 1, 0, or -1 with an exception. The exact key
   holds no neg bit, so a negated view has the key of a plain tensor and must not be served by its entry
   (a raw pointer hands cuDNN the values unnegated; ops._memo refuses it too). A guard tells them apart (the
   Negative dispatch key), so only the exact key's hits ask. */
static int
negated(PyObject *const *args)
{
    Py_ssize_t i;
    for (i = 2; i < 6; i++) {
        PyObject *argv[1] = {args[i]}, *r;
        int t;
        if (args[i] == Py_None)
            continue;
        if (!(r = PyObject_VectorcallMethod(s_is_neg, argv, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)))
            return -1;
        t = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (t != 0)
            return t;
    }
    return 0;
}

static PyObject *
call_entry(PyObject *entry, PyObject *const *args, int guarded)
{
    PyObject *out;
    Py_INCREF(entry); /* the call may clear the memo */
    if (Py_TYPE(entry) == &LaunchType)
        out = launch_call((Launch *)entry, args[2], args[3], args[4], args[5], guarded);
    else
        out = PyObject_Vectorcall(entry, args + 2, 4, NULL);
    Py_DECREF(entry);
    return out;
}

static PyObject *
native_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *memo = NULL, *entry, *det = NULL, *sig = NULL, *ikey = NULL, *targs = NULL, *key = NULL, *lst, *f, *v,
             *out = NULL;
    int t, grad_on;

    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "call(name, grad_name, a, b, c, d, attrs) takes 7 arguments, got %zd", nargs);
        return NULL;
    }
    if (ops_dict == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cudnn_fuse._native: configure() was not called");
        return NULL;
    }
    /* ops._memo's conditions: a plain tensor first, no recording, no torch.func transform */
    if (Py_TYPE(args[2]) != tensor_type)
        goto none;
    if (!(v = global(ops_dict, s_active_recorders)) || PyObject_IsTrue(v) != 0)
        goto none;
    if (call_truth(ops_dict, s_functorch_on) != 0)
        goto none;
    if ((grad_on = call_truth(ops_dict, s_grad_enabled)) < 0)
        goto none;
    if (!(f = global(ops_dict, s_det_algorithms)) || !(det = PyObject_CallNoArgs(f)) || (t = PyObject_IsTrue(det)) < 0)
        goto none;
    if (!t) { /* _det_algorithms() or _det_cudnn() */
        Py_CLEAR(det);
        if (!(f = global(ops_dict, s_det_cudnn)) || !(det = PyObject_CallNoArgs(f)))
            goto none;
    }
    if (!(memo = global(ops_dict, s_FAST)) || !PyDict_Check(memo)) {
        memo = NULL;
        goto none;
    }
    Py_INCREF(memo); /* held: keys, guards and calls below may run Python that rebinds ops' FAST */
    if (!(sig = attr_sig(args[6])))
        goto none;
    if (tensor_guards != NULL && (ikey = index_key(args, sig, det, grad_on)) != NULL && (targs = present(args)) != NULL) {
        lst = PyDict_GetItemWithError(memo, ikey);
        if (lst != NULL && PyList_Check(lst)) {
            Py_INCREF(lst);
            entry = guarded_entry(lst, targs);
            if (entry != NULL) {
                n_guarded++;
                Py_DECREF(lst);
                out = call_entry(entry, args, 1);
                Py_DECREF(entry);
                goto done;
            }
            Py_DECREF(lst);
        }
    }
    PyErr_Clear(); /* an unhashable attribute fails the exact key as well */
    if (!(key = memo_key(args, grad_on, sig, det)))
        goto none;
    entry = PyDict_GetItemWithError(memo, key);
    if (entry == NULL)
        goto none; /* a miss: the Python path validates, builds and remembers */
    /* held before anything else runs: negated() calls torch (whose bindings release the GIL, and which runs
       a subclass's __torch_function__), and another thread that replaces or clears the memo meanwhile would
       free a borrowed entry (a segmentation fault of threaded calls, docs/decisions.md) */
    Py_INCREF(entry);
    {
        PyObject *check = targs != NULL ? guard_make(targs) : NULL; /* the key's snapshot: before is_neg() */
        if (negated(args) != 0) {
            Py_XDECREF(check);
            Py_DECREF(entry);
            goto none; /* a negated view of a remembered signature: the Python path falls back (ops._unlaunchable) */
        }
        n_keyed++;
        if (check != NULL) {
            PyObject *now = PyDict_GetItemWithError(memo, key), *fast = global(ops_dict, s_FAST);
            if (now == entry && fast == memo) /* not cleared or replaced meanwhile */
                guard_register(memo, ikey, entry, check);
            PyErr_Clear();
            Py_DECREF(check);
        }
    }
    out = call_entry(entry, args, 0);
    Py_DECREF(entry);
    goto done;
none:
    PyErr_Clear(); /* unkeyable, or not for the memo: the Python path decides and names bad arguments */
    out = Py_None;
    Py_INCREF(out);
done:
    Py_XDECREF(key);
    Py_XDECREF(targs);
    Py_XDECREF(ikey);
    Py_XDECREF(sig);
    Py_XDECREF(det);
    Py_XDECREF(memo);
    return out;
}

/* ---------------------------------------------------------------------------- module */

static PyObject *
native_configure(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"ops", "plans", "launch_graphs", "tensor", "parameter", "empty_strided", "empty", "float32",
                         "tensor_guards", "data_ptr", NULL};
    PyObject *o, *p, *l, *t, *pt, *es, *e, *f32, *tg = Py_None;
    unsigned long long dp = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!O!OOO|OK:configure", kw, &PyDict_Type, &o, &PyDict_Type,
                                     &p, &PyDict_Type, &l, &PyType_Type, &t, &PyType_Type, &pt, &es, &e, &f32, &tg,
                                     &dp))
        return NULL;
#define SET(var, val) do { Py_INCREF(val); Py_XSETREF(var, val); } while (0)
    SET(ops_dict, o);
    SET(plans_dict, p);
    SET(lg_dict, l);
    Py_INCREF(t);
    Py_XSETREF(tensor_type, (PyTypeObject *)t);
    Py_INCREF(pt);
    Py_XSETREF(parameter_type, (PyTypeObject *)pt);
    if (tg == Py_None)
        Py_CLEAR(tensor_guards);
    else
        SET(tensor_guards, tg);
    data_ptr_fn = (data_ptr_fn_t)(uintptr_t)dp;
    SET(torch_empty_strided, es);
    SET(torch_empty, e);
    SET(float32, f32);
#undef SET
    Py_RETURN_NONE;
}

static PyObject *
native_set_driver(PyObject *module, PyObject *arg)
{
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (addr == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    stream_capturing = (capturing_fn_t)(uintptr_t)addr;
    Py_RETURN_NONE;
}

static PyObject *
native_stats(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("{sKsKsKsK}", "native_replays", n_fast, "native_plan_launches", n_slow, "guarded_hits",
                         n_guarded, "keyed_hits", n_keyed);
}

static PyMethodDef native_methods[] = {
    {"call", (PyCFunction)(void (*)(void))native_call, METH_FASTCALL,
     "call(name, grad_name, a, b, c, d, attrs): ops._memo's lookup and the remembered call, or None on a miss "
     "(or where the memo may not serve: the Python path then runs)."},
    {"configure", (PyCFunction)(void (*)(void))native_configure, METH_VARARGS | METH_KEYWORDS,
     "configure(ops=, plans=, launch_graphs=, tensor=, parameter=, empty_strided=, empty=, float32=, "
     "tensor_guards=None, data_ptr=0): the modules' dicts and torch objects the calls use."},
    {"set_driver", native_set_driver, METH_O,
     "set_driver(address of cuStreamIsCapturing, or 0): how a launch tests its stream for capture (0: through "
     "plans._capturing)."},
    {"attr_sig", native_attr_sig, METH_O,
     "attr_sig(attrs): the attributes' exact types as the memo keys hold them (ops._attr_sig_py's twin)."},
    {"stats", native_stats, METH_NOARGS,
     "{native_replays, native_plan_launches, guarded_hits, keyed_hits}: launches served here and handed to "
     "plan.launch; memo hits through a TensorGuards check and through the exact key."},
    {NULL}};

static struct PyModuleDef native_module = {PyModuleDef_HEAD_INIT, "cudnn_fuse._native",
                                           "The memoized op call in C (see the source's header).", -1,
                                           native_methods};

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *m;
#define INTERN(var, s) if (!(var = PyUnicode_InternFromString(s))) return NULL
    INTERN(s_active_recorders, "_active_recorders");
    INTERN(s_functorch_on, "_functorch_on");
    INTERN(s_grad_enabled, "_grad_enabled");
    INTERN(s_det_algorithms, "_det_algorithms");
    INTERN(s_det_cudnn, "_det_cudnn");
    INTERN(s_FAST, "_FAST");
    INTERN(s_current_stream, "_current_stream");
    INTERN(s_capturing, "_capturing");
    INTERN(s_current_device, "_current_device");
    INTERN(s_workspace_ptr, "_workspace_ptr");
    INTERN(s_ENABLED, "ENABLED");
    INTERN(s_STATS, "STATS");
    INTERN(s_alloc_cuda, "_alloc_cuda");
    INTERN(s_alloc_cpu, "_alloc_cpu");
    INTERN(s_FAST_CAPACITY, "FAST_CAPACITY");
    INTERN(s_check, "check");
    INTERN(s_type, "type");
    INTERN(s_cuda, "cuda");
    INTERN(s_cpu, "cpu");
    INTERN(s_shape, "shape");
    INTERN(s_stride, "stride");
    INTERN(s_dtype, "dtype");
    INTERN(s_device, "device");
    INTERN(s_requires_grad, "requires_grad");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_is_neg, "is_neg");
    INTERN(s_new_empty_strided, "new_empty_strided");
    INTERN(s_launch, "launch");
    INTERN(s_execs, "execs");
    INTERN(s_off, "off");
    INTERN(s_reuses, "reuses");
    INTERN(s_replays, "replays");
#undef INTERN
    if (!(index_mark = PyUnicode_InternFromString("cudnn_fuse._native guarded index")) ||
        !(guard_kwargs = Py_BuildValue("{sOsO}", "dynamic_dims_sizes", Py_None, "dynamic_dims_strides", Py_None)))
        return NULL;
    if (!(empty_tuple = PyTuple_New(0)) || !(alloc_kwnames = Py_BuildValue("(ss)", "dtype", "device")) ||
        !(zero = PyLong_FromLong(0)) || !(one = PyLong_FromLong(1)))
        return NULL;
    if (PyType_Ready(&KernelLaunchType) < 0 || PyType_Ready(&LaunchType) < 0)
        return NULL;
    if (!(m = PyModule_Create(&native_module)))
        return NULL;
    Py_INCREF(&KernelLaunchType);
    if (PyModule_AddObject(m, "KernelLaunch", (PyObject *)&KernelLaunchType) < 0)
        goto fail;
    Py_INCREF(&LaunchType);
    if (PyModule_AddObject(m, "Launch", (PyObject *)&LaunchType) < 0)
        goto fail;
    Py_INCREF(index_mark); /* the first item of the guarded index's keys in ops._FAST */
    if (PyModule_AddObject(m, "INDEX_MARK", index_mark) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
