/* Hot helpers over token-id arrays; twin: edgespec/tokens.py (same behaviour, same tests).
 *
 * common_prefix(a, b): length of the longest common prefix of two int32 buffers. Used on
 * every request to reuse the KV cache of the previous prompt; prompts of tens of thousands
 * of tokens make the Python loop noticeable.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static int get_i32_buffer(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->itemsize != 4 || (view->format && strcmp(view->format, "i") != 0 &&
                                strcmp(view->format, "<i") != 0 && strcmp(view->format, "=i") != 0 &&
                                strcmp(view->format, "l") != 0)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "expected a contiguous buffer of int32 token ids");
        return -1;
    }
    return 0;
}

static PyObject *common_prefix(PyObject *self, PyObject *args) {
    PyObject *a_obj, *b_obj;
    Py_buffer a, b;
    if (!PyArg_ParseTuple(args, "OO", &a_obj, &b_obj)) return NULL;
    if (get_i32_buffer(a_obj, &a) < 0) return NULL;
    if (get_i32_buffer(b_obj, &b) < 0) { PyBuffer_Release(&a); return NULL; }
    const int32_t *pa = (const int32_t *)a.buf, *pb = (const int32_t *)b.buf;
    Py_ssize_t n = a.len / 4 < b.len / 4 ? a.len / 4 : b.len / 4, i = 0;
    while (i < n && pa[i] == pb[i]) i++;
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"common_prefix", common_prefix, METH_VARARGS,
     "common_prefix(a, b) -> int: length of the common prefix of two int32 token buffers"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native_tokens", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native_tokens(void) { return PyModule_Create(&module); }
