/*
 * vmemkv._native: the batched page mapper of the CPU backend.
 *
 * Physical pages live in a memfd; a virtual range is a PROT_NONE reservation. Mapping a page is
 * mmap(MAP_SHARED | MAP_FIXED) of one memfd offset into the reservation; unmapping maps fresh
 * PROT_NONE anonymous memory over it, which gives the addresses back to the reservation.
 *
 * One mmap costs ~4-5 us on our VMs even from C, so the work here is: validate the whole batch,
 * update the page table (an int64 numpy array, -1 = unmapped) and the count of kernel mappings
 * (VMAs) the range costs, refuse the batch without any system call if that count would exceed the
 * caller's budget, then make the system calls with the GIL released, one per run of consecutive
 * virtual pages backed by consecutive physical pages.
 *
 * Kernel mapping count: the kernel merges neighbouring VMAs that are both reservation (anonymous
 * PROT_NONE) or both the memfd at consecutive offsets. So a range's VMA count is the number of
 * virtual pages v that start a new VMA (see starts_vma); it changes only at v and v+1 when
 * page v changes, which keeps the bookkeeping O(batch).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAP_PROT (PROT_READ | PROT_WRITE)
#define MAP_FLAGS (MAP_SHARED | MAP_FIXED)
#define RESERVE_FLAGS (MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)
#define STACK_BATCH 512 /* batches up to this size keep their scratch on the stack */

/* ------------------------------------------------------------------ int64 index buffers */

typedef struct {
    Py_buffer view;
    int64_t *data;
    Py_ssize_t len;
    int held;
} IndexBuffer;

static void release_index_buffer(IndexBuffer *buf) {
    if (buf->held) PyBuffer_Release(&buf->view);
    buf->held = 0;
}

static int is_int64_format(const char *fmt) {
    if (fmt == NULL) return 0;
    if (*fmt == '@' || *fmt == '=') fmt++;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    else if (*fmt == '<') fmt++;
#endif
    return strcmp(fmt, "q") == 0 || strcmp(fmt, "l") == 0;
}

/* Borrow a 1-D contiguous int64 buffer (a numpy int64 array) without copying it. */
static int get_index_buffer(PyObject *obj, IndexBuffer *buf, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    buf->held = 0;
    if (PyObject_GetBuffer(obj, &buf->view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous%s int64 buffer (a numpy int64 array), "
                     "got %.100s", name, writable ? " writable" : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    buf->held = 1;
    if (buf->view.itemsize != 8 || !is_int64_format(buf->view.format) || buf->view.ndim != 1) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D int64 array, got format '%s', %d dims",
                     name, buf->view.format ? buf->view.format : "B", buf->view.ndim);
        release_index_buffer(buf);
        return -1;
    }
    if ((uintptr_t)buf->view.buf % sizeof(int64_t) != 0) {
        PyErr_Format(PyExc_ValueError, "%s is not 8-byte aligned; pass a fresh numpy int64 array", name);
        release_index_buffer(buf);
        return -1;
    }
    buf->data = (int64_t *)buf->view.buf;
    buf->len = buf->view.shape[0];
    return 0;
}

/* Every index in [0, limit), else IndexError naming the first bad one. */
static int check_indices(const IndexBuffer *buf, int64_t limit, const char *what, const char *limit_name) {
    for (Py_ssize_t i = 0; i < buf->len; i++) {
        int64_t x = buf->data[i];
        if (x < 0 || x >= limit) {
            PyErr_Format(PyExc_IndexError, "%s %lld (batch index %zd) is outside %s of %lld pages",
                         what, (long long)x, i, limit_name, (long long)limit);
            return -1;
        }
    }
    return 0;
}

static int check_same_length(const IndexBuffer *a, const IndexBuffer *b) {
    if (a->len != b->len) {
        PyErr_Format(PyExc_ValueError, "virtual_pages has %zd entries but physical_pages has %zd; "
                     "pass one physical page per virtual page", a->len, b->len);
        return -1;
    }
    return 0;
}

/* The batch is read while the table is written: sharing memory would change indices already
   checked (and could write outside the table), so refuse it. */
static int check_no_overlap(const IndexBuffer *table, const IndexBuffer *buf, const char *name) {
    uintptr_t t0 = (uintptr_t)table->data, t1 = t0 + (uintptr_t)table->len * sizeof(int64_t);
    uintptr_t b0 = (uintptr_t)buf->data, b1 = b0 + (uintptr_t)buf->len * sizeof(int64_t);
    if (b0 < t1 && t0 < b1) {
        PyErr_Format(PyExc_ValueError, "%s shares memory with page_table; pass a copy", name);
        return -1;
    }
    return 0;
}

static int check_page_size(Py_ssize_t page_size) {
    long os_page = sysconf(_SC_PAGESIZE);
    if (page_size <= 0 || page_size % os_page != 0) {
        PyErr_Format(PyExc_ValueError, "page_size %zd is not a positive multiple of the OS page (%ld bytes)",
                     page_size, os_page);
        return -1;
    }
    return 0;
}

static PyObject *raise_os_error(int err, const char *what, int64_t virtual_page, int64_t count) {
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "is", err, "");
    if (exc == NULL) return NULL;
    PyObject *msg = PyUnicode_FromFormat("%s of %lld page(s) at virtual page %lld failed: %s",
                                         what, (long long)count, (long long)virtual_page, strerror(err));
    if (msg != NULL) {
        PyObject_SetAttrString(exc, "strerror", msg);
        Py_DECREF(msg);
    }
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

/* ------------------------------------------------------------------ VMA bookkeeping */

/* Does a new kernel mapping (VMA) start at virtual page v of a table of n pages? */
static inline int starts_vma(const int64_t *table, Py_ssize_t n, Py_ssize_t v) {
    if (v >= n) return 0;
    if (v == 0) return 1;
    int64_t prev = table[v - 1], cur = table[v];
    if (prev < 0 && cur < 0) return 0;            /* both reservation */
    if (prev >= 0 && cur == prev + 1) return 0;   /* memfd at consecutive offsets */
    return 1;
}

/* Set table[v] = page and return the change in the range's VMA count. */
static inline int64_t set_page(int64_t *table, Py_ssize_t n, Py_ssize_t v, int64_t page) {
    int64_t before = starts_vma(table, n, v) + starts_vma(table, n, v + 1);
    table[v] = page;
    return starts_vma(table, n, v) + starts_vma(table, n, v + 1) - before;
}

/* Undo entries [from, len) of a batch, last first, so repeated virtual pages end right. */
static int64_t restore_entries(int64_t *table, Py_ssize_t n, const int64_t *virt, const int64_t *old,
                               const int64_t *new_pages, Py_ssize_t from, Py_ssize_t len) {
    int64_t delta = 0;
    for (Py_ssize_t i = len - 1; i >= from; i--)
        if (old[i] != new_pages[i]) delta += set_page(table, n, virt[i], old[i]);
    return delta;
}

static int64_t *scratch_alloc(Py_ssize_t len, int64_t *stack) {
    if (len <= STACK_BATCH) return stack;
    int64_t *heap = PyMem_RawMalloc((size_t)len * sizeof(int64_t));
    if (heap == NULL) PyErr_NoMemory();
    return heap;
}

static void scratch_free(int64_t *scratch, int64_t *stack) {
    if (scratch != stack) PyMem_RawFree(scratch);
}

/* ------------------------------------------------------------------ map_batch / unmap_batch */

static void *page_address(uintptr_t base, Py_ssize_t page_size, int64_t page) {
    return (void *)(base + (uintptr_t)page * (uintptr_t)page_size);
}

PyDoc_STRVAR(map_batch_doc,
"map_batch(fd, base_address, page_size, num_pool_pages, page_table, virtual_pages, physical_pages,\n"
"          room) -> (calls, vma_delta)\n\n"
"Map physical_pages[i] (memfd offsets) at virtual_pages[i] of the range at base_address whose\n"
"page table (int64, -1 = unmapped) is page_table. Entries already mapped as asked are skipped;\n"
"repeated virtual pages take the last entry. vma_delta is the change in the range's kernel mapping\n"
"count. If vma_delta > 0 and > room, the table is left unchanged, no system call is made and\n"
"(0, vma_delta) is returned. IndexError / ValueError for bad input (nothing done), OSError if\n"
"mmap fails (pages before the failing run stay mapped, the failing run is left unmapped, the\n"
"table says so).");

static PyObject *map_batch(PyObject *self, PyObject *args) {
    int fd;
    unsigned long long base;
    Py_ssize_t page_size, num_pool_pages;
    PyObject *table_obj, *virt_obj, *phys_obj;
    long long room;
    if (!PyArg_ParseTuple(args, "iKnnOOOL:map_batch", &fd, &base, &page_size, &num_pool_pages,
                          &table_obj, &virt_obj, &phys_obj, &room))
        return NULL;
    if (check_page_size(page_size) < 0) return NULL;

    IndexBuffer table = {0}, virt = {0}, phys = {0};
    PyObject *result = NULL;
    int64_t stack[STACK_BATCH], *old = NULL;
    if (get_index_buffer(table_obj, &table, 1, "page_table") < 0 ||
        get_index_buffer(virt_obj, &virt, 0, "virtual_pages") < 0 ||
        get_index_buffer(phys_obj, &phys, 0, "physical_pages") < 0 ||
        check_same_length(&virt, &phys) < 0 ||
        check_no_overlap(&table, &virt, "virtual_pages") < 0 ||
        check_no_overlap(&table, &phys, "physical_pages") < 0 ||
        check_indices(&virt, table.len, "virtual page", "the reservation") < 0 ||
        check_indices(&phys, num_pool_pages, "physical page", "the pool") < 0)
        goto done;
    Py_ssize_t len = virt.len, n = table.len;
    const int64_t *v = virt.data, *p = phys.data;
    int64_t *t = table.data;
    if ((old = scratch_alloc(len, stack)) == NULL) goto done;

    int64_t delta = 0;
    for (Py_ssize_t i = 0; i < len; i++) {
        old[i] = t[v[i]];
        if (old[i] != p[i]) delta += set_page(t, n, v[i], p[i]);
    }
    if (delta > 0 && delta > room) {
        restore_entries(t, n, v, old, p, 0, len);
        result = Py_BuildValue("(nL)", (Py_ssize_t)0, (long long)delta);
        goto done;
    }

    Py_ssize_t calls = 0, failed_at = -1, failed_end = -1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < len;) {
        if (old[i] == p[i]) { i++; continue; }
        Py_ssize_t j = i + 1;  /* extend the run while both sides stay consecutive */
        while (j < len && old[j] != p[j] && v[j] == v[j - 1] + 1 && p[j] == p[j - 1] + 1) j++;
        void *addr = mmap(page_address(base, page_size, v[i]), (size_t)(j - i) * page_size, MAP_PROT,
                          MAP_FLAGS, fd, (off_t)p[i] * page_size);
        if (addr == MAP_FAILED) { err = errno; failed_at = i; failed_end = j; break; }
        calls++;
        i = j;
    }
    if (failed_at >= 0)  /* best effort: make the failed run plain reservation again */
        mmap(page_address(base, page_size, v[failed_at]), (size_t)(failed_end - failed_at) * page_size,
             PROT_NONE, RESERVE_FLAGS | MAP_FIXED, -1, 0);
    Py_END_ALLOW_THREADS

    if (failed_at >= 0) {
        restore_entries(t, n, v, old, p, failed_at, len);
        for (Py_ssize_t k = failed_at; k < failed_end; k++) set_page(t, n, v[k], -1);
        raise_os_error(err, "mmap (map)", v[failed_at], failed_end - failed_at);
        goto done;
    }
    result = Py_BuildValue("(nL)", calls, (long long)delta);

done:
    if (old != NULL) scratch_free(old, stack);
    release_index_buffer(&phys);
    release_index_buffer(&virt);
    release_index_buffer(&table);
    return result;
}

PyDoc_STRVAR(unmap_batch_doc,
"unmap_batch(base_address, page_size, page_table, virtual_pages, room) -> (calls, vma_delta)\n\n"
"Give virtual_pages back to the reservation (PROT_NONE) and set their table entries to -1.\n"
"Unmapped pages are skipped; consecutive virtual pages cost one call. Unmapping inside a run\n"
"splits it, so vma_delta can be positive: if it is > room nothing is done and (0, vma_delta)\n"
"is returned. OSError if mmap fails (the table keeps the pages from the failing run on).");

static PyObject *unmap_batch(PyObject *self, PyObject *args) {
    unsigned long long base;
    Py_ssize_t page_size;
    PyObject *table_obj, *virt_obj;
    long long room;
    if (!PyArg_ParseTuple(args, "KnOOL:unmap_batch", &base, &page_size, &table_obj, &virt_obj, &room))
        return NULL;
    if (check_page_size(page_size) < 0) return NULL;

    IndexBuffer table = {0}, virt = {0};
    PyObject *result = NULL;
    int64_t stack[STACK_BATCH], *old = NULL;
    if (get_index_buffer(table_obj, &table, 1, "page_table") < 0 ||
        get_index_buffer(virt_obj, &virt, 0, "virtual_pages") < 0 ||
        check_no_overlap(&table, &virt, "virtual_pages") < 0 ||
        check_indices(&virt, table.len, "virtual page", "the reservation") < 0)
        goto done;
    Py_ssize_t len = virt.len, n = table.len;
    const int64_t *v = virt.data;
    int64_t *t = table.data;
    if ((old = scratch_alloc(len, stack)) == NULL) goto done;

    /* An entry needs a call when the page was mapped; "new" value is -1 for mapped, old for not. */
    int64_t delta = 0;
    for (Py_ssize_t i = 0; i < len; i++) {
        old[i] = t[v[i]];
        if (old[i] >= 0) delta += set_page(t, n, v[i], -1);
    }
    if (delta > 0 && delta > room) {
        for (Py_ssize_t i = len - 1; i >= 0; i--)
            if (old[i] >= 0) set_page(t, n, v[i], old[i]);
        result = Py_BuildValue("(nL)", (Py_ssize_t)0, (long long)delta);
        goto done;
    }

    Py_ssize_t calls = 0, failed_at = -1, failed_end = -1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < len;) {
        if (old[i] < 0) { i++; continue; }
        Py_ssize_t j = i + 1;
        while (j < len && old[j] >= 0 && v[j] == v[j - 1] + 1) j++;
        void *addr = mmap(page_address(base, page_size, v[i]), (size_t)(j - i) * page_size, PROT_NONE,
                          RESERVE_FLAGS | MAP_FIXED, -1, 0);
        if (addr == MAP_FAILED) { err = errno; failed_at = i; failed_end = j; break; }
        calls++;
        i = j;
    }
    Py_END_ALLOW_THREADS

    if (failed_at >= 0) {
        for (Py_ssize_t i = len - 1; i >= failed_at; i--)
            if (old[i] >= 0) set_page(t, n, v[i], old[i]);
        raise_os_error(err, "mmap (unmap)", v[failed_at], failed_end - failed_at);
        goto done;
    }
    result = Py_BuildValue("(nL)", calls, (long long)delta);

done:
    if (old != NULL) scratch_free(old, stack);
    release_index_buffer(&virt);
    release_index_buffer(&table);
    return result;
}

/* ------------------------------------------------------------------ the system-call floor */

PyDoc_STRVAR(map_each_doc,
"map_each(fd, base_address, page_size, num_virtual_pages, num_pool_pages, virtual_pages,\n"
"         physical_pages) -> None\n\n"
"Benchmark floor: one plain mmap per page, no coalescing and no page table (indices are still\n"
"range-checked first, so bad input cannot map over unrelated memory).");

static PyObject *map_each(PyObject *self, PyObject *args) {
    int fd;
    unsigned long long base;
    Py_ssize_t page_size, num_virtual, num_pool;
    PyObject *virt_obj, *phys_obj;
    if (!PyArg_ParseTuple(args, "iKnnnOO:map_each", &fd, &base, &page_size, &num_virtual, &num_pool,
                          &virt_obj, &phys_obj))
        return NULL;
    if (check_page_size(page_size) < 0) return NULL;
    IndexBuffer virt = {0}, phys = {0};
    PyObject *result = NULL;
    if (get_index_buffer(virt_obj, &virt, 0, "virtual_pages") < 0 ||
        get_index_buffer(phys_obj, &phys, 0, "physical_pages") < 0 ||
        check_same_length(&virt, &phys) < 0 ||
        check_indices(&virt, num_virtual, "virtual page", "the reservation") < 0 ||
        check_indices(&phys, num_pool, "physical page", "the pool") < 0)
        goto done;
    Py_ssize_t failed_at = -1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < virt.len; i++) {
        if (mmap(page_address(base, page_size, virt.data[i]), (size_t)page_size, MAP_PROT, MAP_FLAGS, fd,
                 (off_t)phys.data[i] * page_size) == MAP_FAILED) {
            err = errno; failed_at = i; break;
        }
    }
    Py_END_ALLOW_THREADS
    if (failed_at >= 0) raise_os_error(err, "mmap (map_each)", virt.data[failed_at], 1);
    else result = Py_NewRef(Py_None);
done:
    release_index_buffer(&phys);
    release_index_buffer(&virt);
    return result;
}

PyDoc_STRVAR(unmap_each_doc,
"unmap_each(base_address, page_size, num_virtual_pages, virtual_pages) -> None\n\n"
"Benchmark floor: one PROT_NONE mmap per page, no coalescing and no page table.");

static PyObject *unmap_each(PyObject *self, PyObject *args) {
    unsigned long long base;
    Py_ssize_t page_size, num_virtual;
    PyObject *virt_obj;
    if (!PyArg_ParseTuple(args, "KnnO:unmap_each", &base, &page_size, &num_virtual, &virt_obj)) return NULL;
    if (check_page_size(page_size) < 0) return NULL;
    IndexBuffer virt = {0};
    PyObject *result = NULL;
    if (get_index_buffer(virt_obj, &virt, 0, "virtual_pages") < 0 ||
        check_indices(&virt, num_virtual, "virtual page", "the reservation") < 0)
        goto done;
    Py_ssize_t failed_at = -1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < virt.len; i++) {
        if (mmap(page_address(base, page_size, virt.data[i]), (size_t)page_size, PROT_NONE,
                 RESERVE_FLAGS | MAP_FIXED, -1, 0) == MAP_FAILED) {
            err = errno; failed_at = i; break;
        }
    }
    Py_END_ALLOW_THREADS
    if (failed_at >= 0) raise_os_error(err, "mmap (unmap_each)", virt.data[failed_at], 1);
    else result = Py_NewRef(Py_None);
done:
    release_index_buffer(&virt);
    return result;
}

/* ------------------------------------------------------------------ reservations and windows */

PyDoc_STRVAR(reserve_doc,
"reserve(size, alignment) -> address\n\n"
"Reserve size bytes of PROT_NONE, MAP_NORESERVE address space aligned to alignment (a power of\n"
"two multiple of the OS page). Touching it faults until pages are mapped in.");

static PyObject *reserve(PyObject *self, PyObject *args) {
    Py_ssize_t size, alignment;
    if (!PyArg_ParseTuple(args, "nn:reserve", &size, &alignment)) return NULL;
    long os_page = sysconf(_SC_PAGESIZE);
    if (size <= 0 || size % os_page != 0) {
        PyErr_Format(PyExc_ValueError, "reservation size %zd is not a positive multiple of the OS page (%ld)",
                     size, os_page);
        return NULL;
    }
    if (alignment < os_page || (alignment & (alignment - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "alignment %zd is not a power of two >= the OS page (%ld)",
                     alignment, os_page);
        return NULL;
    }
    size_t extra = (size_t)(alignment - os_page);  /* over-reserve, then trim to alignment */
    char *raw = mmap(NULL, (size_t)size + extra, PROT_NONE, RESERVE_FLAGS, -1, 0);
    if (raw == MAP_FAILED) {
        int err = errno;
        return raise_os_error(err, "mmap (reserve)", 0, size / os_page);
    }
    uintptr_t start = ((uintptr_t)raw + (uintptr_t)alignment - 1) & ~((uintptr_t)alignment - 1);
    if (start > (uintptr_t)raw) munmap(raw, start - (uintptr_t)raw);
    uintptr_t end = start + (uintptr_t)size, raw_end = (uintptr_t)raw + size + extra;
    if (raw_end > end) munmap((void *)end, raw_end - end);
    return PyLong_FromUnsignedLongLong((unsigned long long)start);
}

PyDoc_STRVAR(map_shared_doc,
"map_shared(fd, size) -> address\n\nMap the first size bytes of fd read-write, MAP_SHARED.");

static PyObject *map_shared(PyObject *self, PyObject *args) {
    int fd;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "in:map_shared", &fd, &size)) return NULL;
    if (size <= 0) {
        PyErr_Format(PyExc_ValueError, "size %zd must be positive", size);
        return NULL;
    }
    void *addr = mmap(NULL, (size_t)size, MAP_PROT, MAP_SHARED, fd, 0);
    if (addr == MAP_FAILED) {
        int err = errno;
        return raise_os_error(err, "mmap (pool window)", 0, size / sysconf(_SC_PAGESIZE));
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)addr);
}

PyDoc_STRVAR(release_doc, "release(address, size) -> None\n\nmunmap a reservation or window.");

static PyObject *release(PyObject *self, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "Kn:release", &addr, &size)) return NULL;
    if (munmap((void *)(uintptr_t)addr, (size_t)size) != 0) {
        int err = errno;
        return raise_os_error(err, "munmap (release)", 0, size / sysconf(_SC_PAGESIZE));
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ module */

static PyMethodDef methods[] = {
    {"map_batch", map_batch, METH_VARARGS, map_batch_doc},
    {"unmap_batch", unmap_batch, METH_VARARGS, unmap_batch_doc},
    {"map_each", map_each, METH_VARARGS, map_each_doc},
    {"unmap_each", unmap_each, METH_VARARGS, unmap_each_doc},
    {"reserve", reserve, METH_VARARGS, reserve_doc},
    {"map_shared", map_shared, METH_VARARGS, map_shared_doc},
    {"release", release, METH_VARARGS, release_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "vmemkv._native",
    "Batched page mapping for vmemkv's CPU backend (mmap of memfd pages into reservations).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
