/*
 * pg2delta.decode._tuples: the byte-level inner loops of the window decoder.
 *
 * Functions over caller-allocated numpy buffers (buffer protocol, no numpy C API):
 *
 *   walk_changes        one pass over the Insert/Update/Delete messages of a chunk: for every
 *                       row and column, the value kind, start and length of its new and old
 *                       TupleData, every read bounds-checked against the row's end.
 *   walk_copy           the same over binary COPY rows (a bootstrap's copy of a table), as
 *                       many rows as the caller's arrays hold, from a buffer of CopyData blocks.
 *   gather_fixed        the `width` bytes at each start, optionally byte-reversed (big-endian
 *                       wire values to native little-endian numbers).
 *   gather_var          concatenate byte ranges into one bytes object plus int32 offsets
 *                       (the two buffers of an Arrow string/binary array).
 *   numeric_decimal128  binary numerics to Arrow decimal128 values.
 *   numeric_texts       binary numerics to PostgreSQL's text of them.
 *   array_counts,       binary one-dimensional arrays: element counts, then the elements'
 *   array_elements      starts and lengths (the element codec then decodes them in bulk).
 *   hash_ranges         a 64-bit FNV-1a hash of each byte range (a spilled window's rows put in
 *                       buckets by key: equal bytes, equal hash, in every process).
 *   drain_copy          the CopyData messages libpq holds (or can read without waiting) during a
 *                       COPY TO STDOUT, concatenated into one bytes object: libpq's own
 *                       functions, given by address, called in a loop instead of once per row
 *                       from Python.
 *
 * Values these functions do not handle (infinities, multi-dimensional arrays, bad bytes)
 * are reported by index; the Python side then takes its per-value reference path, which
 * says precisely what is wrong.
 *
 * No function reads outside the buffers it is given, whatever the bytes say: malformed
 * messages are reported to the caller (walk_changes returns the row and the reason), which
 * turns them into DecodeError. Byte ranges outside the buffer raise IndexError and wrong
 * buffer sizes ValueError (the Python side checks ranges first, so these would be bugs);
 * more than 2 GiB of output raises OverflowError.
 * The wire format is PostgreSQL's logical replication protocol (pgoutput), TupleData:
 * Int16 column count, then per column a kind byte 'n' (NULL), 'u' (unchanged TOAST),
 * 't' (text) or 'b' (binary), the latter two followed by an Int32 length and the bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A C-contiguous buffer whose size must be exactly `count` items of `itemsize` bytes. */
static int
get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count, int writable, const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->itemsize != itemsize || (count >= 0 && view->len != count * itemsize) || view->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items of %zd bytes, got %zd bytes of items of %zd",
                     name, count, itemsize, view->len, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The buffers one call holds: taken one by one with views_get, all given back by views_release
 * (every function ends through it, whatever failed). */
typedef struct {
    Py_buffer v[12]; /* walk_changes holds 11 */
    int n;
} Views;

/* get_buffer as the next view of `vs`; NULL (exception set) when it fails, with nothing new held. */
static Py_buffer *
views_get(Views *vs, PyObject *obj, Py_ssize_t itemsize, Py_ssize_t count, int writable, const char *name)
{
    if (vs->n >= (int)(sizeof vs->v / sizeof vs->v[0])) {
        PyErr_SetString(PyExc_SystemError, "_tuples: too many buffers in one call");
        return NULL;
    }
    if (get_buffer(obj, &vs->v[vs->n], itemsize, count, writable, name) < 0)
        return NULL;
    return &vs->v[vs->n++];
}

static void
views_release(Views *vs)
{
    while (vs->n > 0)
        PyBuffer_Release(&vs->v[--vs->n]);
}

/* The inputs of the per-value functions: values at buf[starts[i]:starts[i] + lengths[i]]. */
typedef struct {
    const uint8_t *buf;
    Py_ssize_t buflen;
    const int64_t *starts, *lengths;
    Py_ssize_t n;
} Ranges;

/* Take buf, starts and lengths (as many as starts) into `vs` and check that every range lies
 * inside buf: IndexError naming the first that does not. 0, or -1 with an exception set. */
static int
ranges_get(Views *vs, PyObject *o_buf, PyObject *o_starts, PyObject *o_lengths, Ranges *r)
{
    Py_buffer *b = views_get(vs, o_buf, 1, -1, 0, "buf");
    Py_buffer *s = b ? views_get(vs, o_starts, 8, -1, 0, "starts") : NULL;
    Py_buffer *l = s ? views_get(vs, o_lengths, 8, s->len / 8, 0, "lengths") : NULL;
    if (l == NULL)
        return -1;
    r->buf = b->buf;
    r->buflen = b->len;
    r->starts = s->buf;
    r->lengths = l->buf;
    r->n = s->len / 8;
    for (Py_ssize_t i = 0; i < r->n; i++) {
        int64_t st = r->starts[i], len = r->lengths[i];
        if (st < 0 || len < 0 || st > r->buflen || len > r->buflen - st) {
            PyErr_Format(PyExc_IndexError, "value %zd: byte range outside the buffer", i);
            return -1;
        }
    }
    return 0;
}

static inline uint32_t
be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

/* Output arrays of one TupleData side, column-major: element [c * n + row]. */
typedef struct {
    uint8_t *kinds;
    int64_t *starts;
    int64_t *lengths;
} Side;

/* Walk one TupleData at `q`, which must end by `end`. Returns the offset after it, or -1
 * with *why set and *at the offset of the part that is wrong. */
static int64_t
walk_tuple(const uint8_t *buf, int64_t q, int64_t end, Py_ssize_t ncols, Side *s, Py_ssize_t n, Py_ssize_t row,
           const char **why, int64_t *at)
{
    *at = q;
    if (end - q < 2) {
        *why = "tuple ends in its column count";
        return -1;
    }
    if (((Py_ssize_t)buf[q] << 8 | buf[q + 1]) != ncols) {
        *why = "tuple column count differs from the relation's";
        return -1;
    }
    q += 2;
    for (Py_ssize_t c = 0; c < ncols; c++) {
        Py_ssize_t i = c * n + row;
        *at = q;
        if (q >= end) {
            *why = "tuple ends before its last column";
            return -1;
        }
        uint8_t k = buf[q];
        s->kinds[i] = k;
        if (k == 't' || k == 'b') {
            if (end - q < 5) {
                *why = "tuple ends in a value length";
                return -1;
            }
            uint32_t len = be32(buf + q + 1); /* an Int32 on the wire */
            if (len > INT32_MAX) {
                *why = "negative value length";
                return -1;
            }
            if ((int64_t)len > end - (q + 5)) {
                *why = "value length past the end of the message";
                return -1;
            }
            s->starts[i] = q + 5;
            s->lengths[i] = len;
            q += 5 + len;
        } else if (k == 'n' || k == 'u') {
            s->starts[i] = 0;
            s->lengths[i] = 0;
            q += 1;
        } else {
            *why = "unknown value kind byte";
            return -1;
        }
    }
    return q;
}

/* The first malformed row, or -1; *why says what is wrong with it, *at where (an offset in buf). */
static Py_ssize_t
walk_rows(const uint8_t *buf, Py_ssize_t buflen, const uint8_t *tags, const int64_t *offs, const int64_t *ends,
          Py_ssize_t n, Py_ssize_t ncols, Side *new_side, Side *old_side, uint8_t *markers, const char **why,
          int64_t *at)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t q = offs[i], end = ends[i];
        *at = q;
        if (q < 0 || end > buflen || q >= end) {
            *why = "message ends before its tuple";
            return i;
        }
        uint8_t tag = tags[i], m = buf[q];
        markers[i] = 0;
        if (tag == 'U' || tag == 'D') {
            if (m == 'K' || m == 'O') {
                markers[i] = m;
                q = walk_tuple(buf, q + 1, end, ncols, old_side, n, i, why, at);
                if (q < 0)
                    return i;
            } else if (tag == 'D') {
                *why = "delete without K or O tuple";
                return i;
            }
        }
        if (tag == 'I' || tag == 'U') {
            *at = q;
            if (q >= end || buf[q] != 'N') {
                *why = "missing N tuple";
                return i;
            }
            q = walk_tuple(buf, q + 1, end, ncols, new_side, n, i, why, at);
            if (q < 0)
                return i;
        } else if (tag != 'D') {
            *why = "not an Insert, Update or Delete message";
            return i;
        }
        if (q != end) {
            *at = q;
            *why = "trailing bytes after tuple";
            return i;
        }
    }
    return -1;
}

PyDoc_STRVAR(walk_changes_doc,
"walk_changes(buf, tags, offs, ends, ncols, new_kinds, new_starts, new_lengths,\n"
"             old_kinds, old_starts, old_lengths, markers) -> None | tuple[int, str, int]\n\n"
"Walk the tuples of n change messages. Row i has tag tags[i] ('I', 'U' or 'D'), its\n"
"K/O/N marker at buf[offs[i]] and ends at ends[i]. Fills the (ncols, n) uint8/int64\n"
"arrays of kinds, starts and lengths of the new and old tuples and markers[i] ('K', 'O'\n"
"or 0 when there is no old tuple). The old side of rows without an old tuple and the new\n"
"side of Deletes are left as they were. Returns None, or\n"
"(row, reason, offset in buf) for the first malformed row.");

static PyObject *
walk_changes(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_buf, *o_tags, *o_offs, *o_ends, *o_out[7];
    Py_ssize_t ncols;
    if (!PyArg_ParseTuple(args, "OOOOnOOOOOOO", &o_buf, &o_tags, &o_offs, &o_ends, &ncols, &o_out[0], &o_out[1],
                          &o_out[2], &o_out[3], &o_out[4], &o_out[5], &o_out[6]))
        return NULL;
    if (ncols < 0 || ncols > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "ncols out of range");
        return NULL;
    }
    static const Py_ssize_t out_sizes[7] = {1, 8, 8, 1, 8, 8, 1};
    static const char *out_names[7] = {"new_kinds", "new_starts", "new_lengths", "old_kinds", "old_starts",
                                       "old_lengths", "markers"};
    Views vs = {.n = 0};
    Py_buffer *out[7];
    PyObject *result = NULL;
    /* buf and tags are bytes; offs and ends hold n int64 each, n being the length of tags */
    Py_buffer *b_buf = views_get(&vs, o_buf, 1, -1, 0, "buf");
    Py_buffer *b_tags = b_buf ? views_get(&vs, o_tags, 1, -1, 0, "tags") : NULL;
    Py_ssize_t n = b_tags ? b_tags->len : 0;
    Py_buffer *b_offs = b_tags ? views_get(&vs, o_offs, 8, n, 0, "offs") : NULL;
    Py_buffer *b_ends = b_offs ? views_get(&vs, o_ends, 8, n, 0, "ends") : NULL;
    if (b_ends == NULL)
        goto done;
    for (int k = 0; k < 7; k++) {
        Py_ssize_t count = k == 6 ? n : ncols * n;
        if ((out[k] = views_get(&vs, o_out[k], out_sizes[k], count, 1, out_names[k])) == NULL)
            goto done;
    }
    Side new_side = {out[0]->buf, out[1]->buf, out[2]->buf};
    Side old_side = {out[3]->buf, out[4]->buf, out[5]->buf};
    const char *why = NULL;
    int64_t at = 0;
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = walk_rows(b_buf->buf, b_buf->len, b_tags->buf, b_offs->buf, b_ends->buf, n, ncols, &new_side, &old_side,
                    out[6]->buf, &why, &at);
    Py_END_ALLOW_THREADS
    if (bad < 0)
        result = Py_NewRef(Py_None);
    else
        result = Py_BuildValue("(nsL)", bad, why, (long long)at);
done:
    views_release(&vs);
    return result;
}

/* Binary COPY rows (COPY ... TO STDOUT (FORMAT binary), after the file header): per row an
 * Int16 field count, then per field an Int32 length (-1: NULL) and the bytes; the data ends with
 * an Int16 -1. Walks rows from `pos` into the column-major (ncols, cap) outputs until `cap` rows
 * are walked, the bytes end (a row cut at the buffer's end is left for the next call) or the
 * trailer is read. Returns the status; *rows is the rows walked, *next the offset after them
 * (after the trailer for COPY_END; for COPY_BAD the offset of the bad part, *rows the bad row). */
enum { COPY_MORE = 0, COPY_END = 1, COPY_BAD = 2 };

static int
walk_copy_rows(const uint8_t *buf, int64_t buflen, int64_t pos, Py_ssize_t ncols, const uint8_t *value_kinds,
               Py_ssize_t cap, Side *s, Py_ssize_t *rows, int64_t *next, const char **why)
{
    Py_ssize_t r = 0;
    int status = COPY_MORE;
    while (r < cap) {
        int64_t q = pos;
        if (buflen - q < 2)
            break; /* the next row (or the trailer) is not all here yet */
        uint16_t fc = (uint16_t)((uint16_t)buf[q] << 8 | buf[q + 1]);
        if (fc == 0xFFFF) {
            pos = q + 2;
            status = COPY_END;
            break;
        }
        if ((Py_ssize_t)fc != ncols) {
            *why = "row field count differs from the table's column count";
            *rows = r;
            *next = q;
            return COPY_BAD;
        }
        q += 2;
        int cut = 0;
        for (Py_ssize_t c = 0; c < ncols; c++) {
            Py_ssize_t i = c * cap + r;
            if (buflen - q < 4) {
                cut = 1;
                break;
            }
            uint32_t len = be32(buf + q);
            if (len == 0xFFFFFFFFu) {
                s->kinds[i] = 'n';
                s->starts[i] = 0;
                s->lengths[i] = 0;
                q += 4;
                continue;
            }
            if (len > INT32_MAX) {
                *why = "negative field length other than -1";
                *rows = r;
                *next = q;
                return COPY_BAD;
            }
            if ((int64_t)len > buflen - (q + 4)) {
                cut = 1;
                break;
            }
            s->kinds[i] = value_kinds[c];
            s->starts[i] = q + 4;
            s->lengths[i] = len;
            q += 4 + len;
        }
        if (cut)
            break;
        pos = q;
        r++;
    }
    *rows = r;
    *next = pos;
    return status;
}

PyDoc_STRVAR(walk_copy_doc,
"walk_copy(buf, pos, ncols, value_kinds, kinds, starts, lengths) -> (rows, next, status, reason)\n\n"
"Walk binary COPY rows from buf[pos] (after the file header) into the (ncols, cap) uint8/int64\n"
"arrays kinds, starts and lengths (element [c * cap + row]); a NULL field gets kind 'n', any\n"
"other field of column c the kind value_kinds[c]. Stops after cap rows, at the end of the bytes\n"
"(a row cut at the end of buf is not walked: status 0, next is where it starts), or after the\n"
"trailer (status 1, next after it). Status 2: row `rows` is malformed at offset next, reason says\n"
"how (reason is None otherwise).");

static PyObject *
walk_copy(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_buf, *o_vk, *o_kinds, *o_starts, *o_lengths;
    Py_ssize_t pos, ncols;
    if (!PyArg_ParseTuple(args, "OnnOOOO", &o_buf, &pos, &ncols, &o_vk, &o_kinds, &o_starts, &o_lengths))
        return NULL;
    if (ncols < 1 || ncols > 0xFFFE) {
        PyErr_SetString(PyExc_ValueError, "ncols out of range");
        return NULL;
    }
    Views vs = {.n = 0};
    PyObject *result = NULL;
    Py_buffer *b_buf = views_get(&vs, o_buf, 1, -1, 0, "buf");
    Py_buffer *b_vk = b_buf ? views_get(&vs, o_vk, 1, ncols, 0, "value_kinds") : NULL;
    Py_buffer *b_kinds = b_vk ? views_get(&vs, o_kinds, 1, -1, 1, "kinds") : NULL;
    if (b_kinds == NULL)
        goto done;
    if (b_kinds->len % ncols) {
        PyErr_SetString(PyExc_ValueError, "kinds: size is not a multiple of ncols");
        goto done;
    }
    Py_ssize_t cap = b_kinds->len / ncols;
    Py_buffer *b_starts = views_get(&vs, o_starts, 8, ncols * cap, 1, "starts");
    Py_buffer *b_lengths = b_starts ? views_get(&vs, o_lengths, 8, ncols * cap, 1, "lengths") : NULL;
    if (b_lengths == NULL)
        goto done;
    if (pos < 0 || pos > b_buf->len) {
        PyErr_SetString(PyExc_IndexError, "pos outside the buffer");
        goto done;
    }
    Side side = {b_kinds->buf, b_starts->buf, b_lengths->buf};
    const char *why = NULL;
    Py_ssize_t rows = 0;
    int64_t next = 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = walk_copy_rows(b_buf->buf, b_buf->len, pos, ncols, b_vk->buf, cap, &side, &rows, &next, &why);
    Py_END_ALLOW_THREADS
    if (status == COPY_BAD)
        result = Py_BuildValue("(nLis)", rows, (long long)next, status, why);
    else
        result = Py_BuildValue("(nLiO)", rows, (long long)next, status, Py_None);
done:
    views_release(&vs);
    return result;
}

PyDoc_STRVAR(gather_fixed_doc,
"gather_fixed(buf, starts, width, out, swap) -> None\n\n"
"Copy the width bytes at each starts[i] to out[i * width:], reversed if swap\n"
"(big-endian wire values to little-endian numbers). IndexError if a range leaves buf.");

static PyObject *
gather_fixed(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_buf, *o_starts, *o_out;
    Py_ssize_t width;
    int swap;
    if (!PyArg_ParseTuple(args, "OOnOp", &o_buf, &o_starts, &width, &o_out, &swap))
        return NULL;
    if (width < 1 || width > 64) {
        PyErr_SetString(PyExc_ValueError, "width out of range");
        return NULL;
    }
    Views vs = {.n = 0};
    Py_buffer *b_buf = views_get(&vs, o_buf, 1, -1, 0, "buf");
    Py_buffer *b_starts = b_buf ? views_get(&vs, o_starts, 8, -1, 0, "starts") : NULL;
    Py_ssize_t n = b_starts ? b_starts->len / 8 : 0;
    Py_buffer *b_out = b_starts ? views_get(&vs, o_out, 1, n * width, 1, "out") : NULL;
    PyObject *result = NULL;
    if (b_out == NULL)
        goto done;
    const uint8_t *buf = b_buf->buf;
    const int64_t *starts = b_starts->buf;
    uint8_t *out = b_out->buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = starts[i];
        if (s < 0 || s > b_buf->len - width) {
            PyErr_Format(PyExc_IndexError, "value %zd: byte range outside the buffer", i);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    if (!swap) {
        for (Py_ssize_t i = 0; i < n; i++)
            memcpy(out + i * width, buf + starts[i], width);
    } else if (width == 2) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint16_t v;
            memcpy(&v, buf + starts[i], 2);
            v = __builtin_bswap16(v);
            memcpy(out + i * 2, &v, 2);
        }
    } else if (width == 4) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t v;
            memcpy(&v, buf + starts[i], 4);
            v = __builtin_bswap32(v);
            memcpy(out + i * 4, &v, 4);
        }
    } else if (width == 8) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t v;
            memcpy(&v, buf + starts[i], 8);
            v = __builtin_bswap64(v);
            memcpy(out + i * 8, &v, 8);
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            for (Py_ssize_t j = 0; j < width; j++)
                out[i * width + j] = buf[starts[i] + width - 1 - j];
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    views_release(&vs);
    return result;
}

PyDoc_STRVAR(gather_var_doc,
"gather_var(buf, starts, lengths, offsets) -> bytes\n\n"
"Concatenate buf[starts[i]:starts[i] + lengths[i]] for every i; fill offsets (int32,\n"
"n + 1 items) with where each range begins in the result and its total at the end.\n"
"IndexError if a range leaves buf or has a negative length, OverflowError past 2 GiB.");

static PyObject *
gather_var(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_buf, *o_starts, *o_lengths, *o_offsets;
    if (!PyArg_ParseTuple(args, "OOOO", &o_buf, &o_starts, &o_lengths, &o_offsets))
        return NULL;
    Views vs = {.n = 0};
    Ranges r;
    Py_buffer *b_offsets;
    PyObject *result = NULL;
    if (ranges_get(&vs, o_buf, o_starts, o_lengths, &r) < 0
        || (b_offsets = views_get(&vs, o_offsets, 4, r.n + 1, 1, "offsets")) == NULL)
        goto done;
    int32_t *offsets = b_offsets->buf;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < r.n; i++) {
        offsets[i] = (int32_t)total;
        total += r.lengths[i];
        if (total > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "more than 2 GiB of values in one column chunk");
            goto done;
        }
    }
    offsets[r.n] = (int32_t)total;
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (result != NULL) {
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(result);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < r.n; i++)
            memcpy(dst + offsets[i], r.buf + r.starts[i], (size_t)r.lengths[i]);
        Py_END_ALLOW_THREADS
    }
done:
    views_release(&vs);
    return result;
}

/* What numeric_scaled needs to know about the target decimal(precision, scale). */
typedef struct {
    int scale;
    int k;              /* base-10000 fractional positions that cover `scale` decimals */
    int last_mul;       /* the last position (-k) counts 10^(scale - 4(k-1)) ... */
    int last_div;       /* ... of its digit divided by 10^(4k - scale) */
    __int128 limit;     /* 10^precision */
    __int128 max_10000; /* the largest value that can still be multiplied by 10000 below limit */
    __int128 max_last;  /* the same for last_mul */
} NumericSpec;

static NumericSpec
numeric_spec(int precision, int scale)
{
    NumericSpec s = {.scale = scale, .k = (scale + 3) / 4, .last_mul = 1, .last_div = 1, .limit = 1};
    for (int j = 0; j < precision; j++)
        s.limit *= 10;
    if (s.k) {
        for (int j = 0; j < scale - 4 * (s.k - 1); j++)
            s.last_mul *= 10;
        for (int j = 0; j < 4 * s.k - scale; j++)
            s.last_div *= 10;
    }
    s.max_10000 = (s.limit - 1) / 10000;
    s.max_last = (s.limit - 1) / s.last_mul;
    return s;
}

static inline int
digit_at(const uint8_t *p, int i)
{
    return p[8 + 2 * i] << 8 | p[9 + 2 * i];
}

/* One binary numeric (PostgreSQL's numeric_send: Int16 ndigits, Int16 weight, UInt16 sign,
 * Int16 dscale, then ndigits base-10000 digits, the first at 10000^weight) as the integer
 * value * 10^scale, below 10^precision in magnitude. Returns 1 for a number, 0 for NaN, -1
 * for anything else (infinities, out of range, more fractional digits than scale or dscale,
 * malformed): the caller's reference path decides what those are. */
static int
numeric_scaled(const uint8_t *p, int64_t len, const NumericSpec *spec, __int128 *out)
{
    if (len < 8)
        return -1;
    int ndigits = (int16_t)(p[0] << 8 | p[1]);
    int weight = (int16_t)(p[2] << 8 | p[3]);
    unsigned sign = (unsigned)(p[4] << 8 | p[5]);
    int dscale = (int16_t)(p[6] << 8 | p[7]);
    if (ndigits < 0 || len != 8 + 2 * (int64_t)ndigits || dscale < 0)
        return -1;
    for (int i = 0; i < ndigits; i++)
        if (digit_at(p, i) >= 10000)
            return -1;
    if (sign == 0xC000)
        return 0;
    if (sign != 0x0000 && sign != 0x4000)
        return -1;
    /* Horner over base-10000 positions weight .. -k; the last one (-k) is scaled by last_mul
     * after dropping the decimals past `scale`, which must be zeros. */
    int k = spec->k;
    __int128 v = 0;
    for (int pos = weight; pos >= -k; pos--) {
        int i = weight - pos;
        int d = i < ndigits ? digit_at(p, i) : 0;
        if (k && pos == -k) {
            if (d % spec->last_div || v > spec->max_last)
                return -1;
            v = v * spec->last_mul + d / spec->last_div;
        } else {
            if (v > spec->max_10000)
                return -1;
            v = v * 10000 + d;
        }
        if (v >= spec->limit)
            return -1;
    }
    /* digits below position -k must be zero */
    for (int i = weight + k + 1 > 0 ? weight + k + 1 : 0; i < ndigits; i++)
        if (digit_at(p, i))
            return -1;
    /* and so must the decimals between dscale and scale (numeric_out prints dscale of them) */
    if (dscale < spec->scale) {
        __int128 unit = 1;
        for (int j = dscale; j < spec->scale; j++)
            unit *= 10;
        if (v % unit)
            return -1;
    }
    *out = sign == 0x4000 ? -v : v;
    return 1;
}

PyDoc_STRVAR(numeric_decimal128_doc,
"numeric_decimal128(buf, starts, lengths, scale, precision, out, valid) -> int\n\n"
"Binary numerics to Arrow decimal128(precision, scale): out gets 16 bytes per value (low\n"
"64 bits first, two's complement), valid[i] is 0 for NaN, else 1. Returns -1, or the index\n"
"of the first value that is not a finite number that fits exactly (the caller's per-value\n"
"path then says what it is). IndexError if a range leaves buf.");

static PyObject *
numeric_decimal128(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_buf, *o_starts, *o_lengths, *o_out, *o_valid;
    int scale, precision;
    if (!PyArg_ParseTuple(args, "OOOiiOO", &o_buf, &o_starts, &o_lengths, &scale, &precision, &o_out, &o_valid))
        return NULL;
    if (precision < 1 || precision > 38 || scale < 0 || scale > precision) {
        PyErr_SetString(PyExc_ValueError, "precision or scale out of range");
        return NULL;
    }
    Views vs = {.n = 0};
    Ranges r;
    Py_buffer *b_out, *b_valid;
    PyObject *result = NULL;
    if (ranges_get(&vs, o_buf, o_starts, o_lengths, &r) < 0
        || (b_out = views_get(&vs, o_out, 1, 16 * r.n, 1, "out")) == NULL
        || (b_valid = views_get(&vs, o_valid, 1, r.n, 1, "valid")) == NULL)
        goto done;
    uint8_t *out = b_out->buf, *valid = b_valid->buf;
    NumericSpec spec = numeric_spec(precision, scale);
    Py_ssize_t first_other = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < r.n; i++) {
        __int128 v = 0;
        int k = numeric_scaled(r.buf + r.starts[i], r.lengths[i], &spec, &v);
        if (k < 0) {
            first_other = i;
            break;
        }
        unsigned __int128 u = (unsigned __int128)v;
        uint64_t lo = (uint64_t)u, hi = (uint64_t)(u >> 64);
        memcpy(out + 16 * i, &lo, 8);
        memcpy(out + 16 * i + 8, &hi, 8);
        valid[i] = (uint8_t)k;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(first_other);
done:
    views_release(&vs);
    return result;
}

/* numeric_out of one binary numeric, as pg2delta's reference (typemap.numeric._numeric_text) prints
 * it: into out when out is not NULL; returns its length, or -1 when the bytes are not a
 * numeric (the reference path then says why). */
static int64_t
numeric_text(const uint8_t *p, int64_t len, char *out)
{
    if (len < 8)
        return -1;
    int ndigits = (int16_t)(p[0] << 8 | p[1]);
    int weight = (int16_t)(p[2] << 8 | p[3]);
    unsigned sign = (unsigned)(p[4] << 8 | p[5]);
    int dscale = (int16_t)(p[6] << 8 | p[7]);
    if (ndigits < 0 || len != 8 + 2 * (int64_t)ndigits || dscale < 0)
        return -1;
    if (sign != 0x0000 && sign != 0x4000 && sign != 0xC000 && sign != 0xD000 && sign != 0xF000)
        return -1;
    for (int i = 0; i < ndigits; i++)
        if (digit_at(p, i) >= 10000)
            return -1;
    const char *special = sign == 0xC000 ? "NaN" : sign == 0xD000 ? "Infinity" : sign == 0xF000 ? "-Infinity" : NULL;
    if (special) {
        int64_t n = (int64_t)strlen(special);
        if (out)
            memcpy(out, special, (size_t)n);
        return n;
    }
    int64_t n = 0;
#define PUT(ch)              \
    do {                     \
        if (out)             \
            out[n] = (ch);   \
        n++;                 \
    } while (0)
    if (sign == 0x4000)
        PUT('-');
    /* integer part: groups 0 .. weight (missing ones are zeros), leading zeros dropped */
    int started = 0;
    for (int i = 0; i <= weight; i++) {
        int d = i < ndigits ? digit_at(p, i) : 0;
        for (int e = 1000; e; e /= 10) {
            int ch = d / e % 10;
            if (ch || started) {
                PUT((char)('0' + ch));
                started = 1;
            }
        }
    }
    if (!started)
        PUT('0');
    /* fraction: exactly dscale decimals, from the groups after position 0, zeros past them */
    if (dscale > 0) {
        PUT('.');
        int64_t lead = weight < 0 ? 4 * ((int64_t)-weight - 1) : 0; /* zeros before the first group */
        int first = weight < 0 ? 0 : weight + 1;                      /* first group of the fraction */
        for (int64_t j = 0; j < dscale; j++) {
            int ch = 0;
            if (j >= lead) {
                int64_t i = first + (j - lead) / 4;
                if (i < ndigits) {
                    static const int div[4] = {1000, 100, 10, 1};
                    ch = digit_at(p, (int)i) / div[(j - lead) % 4] % 10;
                }
            }
            PUT((char)('0' + ch));
        }
    }
#undef PUT
    return n;
}

PyDoc_STRVAR(numeric_texts_doc,
"numeric_texts(buf, starts, lengths, offsets) -> bytes | int\n\n"
"PostgreSQL's text of each binary numeric, concatenated, with int32 offsets (n + 1 items)\n"
"like gather_var; or, when a value is not a numeric, its index. IndexError if a range\n"
"leaves buf, OverflowError past 2 GiB.");

static PyObject *
numeric_texts(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_buf, *o_starts, *o_lengths, *o_offsets;
    if (!PyArg_ParseTuple(args, "OOOO", &o_buf, &o_starts, &o_lengths, &o_offsets))
        return NULL;
    Views vs = {.n = 0};
    Ranges r;
    Py_buffer *b_offsets;
    PyObject *result = NULL;
    if (ranges_get(&vs, o_buf, o_starts, o_lengths, &r) < 0
        || (b_offsets = views_get(&vs, o_offsets, 4, r.n + 1, 1, "offsets")) == NULL)
        goto done;
    int32_t *offsets = b_offsets->buf;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < r.n; i++) {
        int64_t size = numeric_text(r.buf + r.starts[i], r.lengths[i], NULL);
        if (size < 0) {
            result = PyLong_FromSsize_t(i);
            goto done;
        }
        offsets[i] = (int32_t)total;
        total += size;
        if (total > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "more than 2 GiB of values in one column chunk");
            goto done;
        }
    }
    offsets[r.n] = (int32_t)total;
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (result != NULL) {
        char *dst = PyBytes_AS_STRING(result);
        for (Py_ssize_t i = 0; i < r.n; i++)
            numeric_text(r.buf + r.starts[i], r.lengths[i], dst + offsets[i]);
    }
done:
    views_release(&vs);
    return result;
}

/* One binary array (array_send: Int32 ndim, Int32 flags, UInt32 element type, then per
 * dimension Int32 size and Int32 lower bound, then per element Int32 length (-1 NULL) and
 * its bytes). Returns its element count when it has at most one dimension, lower bound 1,
 * elements of type elem_oid (if not 0) and is well formed, else -1. With estarts (offsets
 * in buf of the value's first byte `base`), fills the elements' starts and lengths. */
static int64_t
array_1d(const uint8_t *p, int64_t len, uint32_t elem_oid, int64_t base, int64_t *estarts, int64_t *elens)
{
    if (len < 12)
        return -1;
    int32_t ndim = (int32_t)be32(p);
    uint32_t elem = be32(p + 8);
    int64_t pos = 12, count = 0;
    if (ndim == 1) {
        if (len < 20)
            return -1;
        uint32_t dim = be32(p + 12), lb = be32(p + 16);
        if (dim > INT32_MAX || lb != 1 || (int64_t)dim > len)
            return -1;
        count = dim;
        pos = 20;
    } else if (ndim != 0) {
        return -1;
    }
    if (count && elem_oid && elem != elem_oid)
        return -1;
    for (int64_t i = 0; i < count; i++) {
        if (len - pos < 4)
            return -1;
        uint32_t raw = be32(p + pos);
        pos += 4;
        int64_t n = raw == 0xFFFFFFFFu ? -1 : raw > INT32_MAX ? -2 : (int64_t)raw;
        if (n < -1 || (n > 0 && n > len - pos))
            return -1;
        if (estarts) {
            estarts[i] = base + pos;
            elens[i] = n;
        }
        if (n > 0)
            pos += n;
    }
    return pos == len ? count : -1;
}

PyDoc_STRVAR(array_counts_doc,
"array_counts(buf, starts, lengths, elem_oid, counts) -> int\n\n"
"For binary arrays of at most one dimension with lower bound 1 and elements of type\n"
"elem_oid (0: any), their element counts into counts (int64). Returns -1, or the index\n"
"of the first value that is not such an array. IndexError if a range leaves buf.");

PyDoc_STRVAR(array_elements_doc,
"array_elements(buf, starts, lengths, elem_oid, estarts, elens) -> int\n\n"
"The element starts (offsets in buf) and lengths (-1 for NULL) of the arrays that\n"
"array_counts accepted, concatenated; estarts and elens hold the sum of their counts.\n"
"Returns -1, or the index of a value that is not such an array.");

static PyObject *
array_walk(PyObject *args, int fill)
{
    PyObject *o_buf, *o_starts, *o_lengths, *o_a, *o_b = NULL;
    unsigned int elem_oid;
    if (fill ? !PyArg_ParseTuple(args, "OOOIOO", &o_buf, &o_starts, &o_lengths, &elem_oid, &o_a, &o_b)
             : !PyArg_ParseTuple(args, "OOOIO", &o_buf, &o_starts, &o_lengths, &elem_oid, &o_a))
        return NULL;
    Views vs = {.n = 0};
    Ranges r;
    Py_buffer *b_a, *b_b = NULL;
    PyObject *result = NULL;
    if (ranges_get(&vs, o_buf, o_starts, o_lengths, &r) < 0
        || (b_a = views_get(&vs, o_a, 8, fill ? -1 : r.n, 1, fill ? "estarts" : "counts")) == NULL
        || (fill && (b_b = views_get(&vs, o_b, 8, b_a->len / 8, 1, "elens")) == NULL))
        goto done;
    int64_t *a = b_a->buf, room = b_a->len / 8, used = 0;
    Py_ssize_t other = -1;
    for (Py_ssize_t i = 0; i < r.n && other < 0; i++) {
        const uint8_t *p = r.buf + r.starts[i];
        int64_t count = array_1d(p, r.lengths[i], elem_oid, r.starts[i], NULL, NULL);
        if (count < 0 || (fill && count > room - used)) {
            other = i;
        } else if (fill) {
            array_1d(p, r.lengths[i], elem_oid, r.starts[i], a + used, (int64_t *)b_b->buf + used);
            used += count;
        } else {
            a[i] = count;
        }
    }
    if (fill && other < 0 && used != room)
        other = r.n; /* fewer elements than the caller made room for */
    result = PyLong_FromSsize_t(other);
done:
    views_release(&vs);
    return result;
}

static PyObject *
array_counts(PyObject *self, PyObject *args)
{
    (void)self;
    return array_walk(args, 0);
}

static PyObject *
array_elements(PyObject *self, PyObject *args)
{
    (void)self;
    return array_walk(args, 1);
}

PyDoc_STRVAR(hash_ranges_doc,
"hash_ranges(buf, starts, lengths, out, /) -> None\n\n"
"The 64-bit FNV-1a hash of each value buf[starts[i]:starts[i] + lengths[i]] into out[i] (uint64,\n"
"one per start): equal bytes give an equal hash, in every process and on every machine.");

static PyObject *
hash_ranges(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_buf, *o_starts, *o_lengths, *o_out;
    if (!PyArg_ParseTuple(args, "OOOO", &o_buf, &o_starts, &o_lengths, &o_out))
        return NULL;
    Views vs = {.n = 0};
    Ranges r;
    Py_buffer *b_out;
    PyObject *result = NULL;
    if (ranges_get(&vs, o_buf, o_starts, o_lengths, &r) < 0
        || (b_out = views_get(&vs, o_out, 8, r.n, 1, "out")) == NULL)
        goto done;
    uint64_t *out = b_out->buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < r.n; i++) {
        const uint8_t *p = r.buf + r.starts[i];
        uint64_t h = 14695981039346656037ULL;
        for (int64_t j = 0; j < r.lengths[i]; j++) {
            h ^= p[j];
            h *= 1099511628211ULL;
        }
        out[i] = h;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    views_release(&vs);
    return result;
}

/* libpq's functions, as drain_copy is given them (by address: the library psycopg loaded). */
typedef int (*pq_get_copy_data_fn)(void *conn, char **buffer, int async);
typedef void (*pq_freemem_fn)(void *ptr);
typedef int (*pq_consume_input_fn)(void *conn);

PyDoc_STRVAR(drain_copy_doc,
"drain_copy(get_copy_data, freemem, consume_input, conn, limit, /) -> (status, bytes)\n\n"
"The CopyData messages of a COPY TO STDOUT that libpq holds, or reads from the socket without\n"
"waiting (the connection is non-blocking), concatenated, until `limit` bytes or more are taken.\n"
"The first four arguments are the addresses of PQgetCopyData, PQfreemem, PQconsumeInput and the\n"
"PGconn. status: 1 the limit was reached (more may be ready), 0 nothing more without waiting,\n"
"-1 the end of the copy (its result is still to be read), -2 an error (PQerrorMessage says it).");

static PyObject *
drain_copy(PyObject *self, PyObject *args)
{
    unsigned long long get_addr, free_addr, consume_addr, conn_addr;
    Py_ssize_t limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKn:drain_copy", &get_addr, &free_addr, &consume_addr, &conn_addr, &limit))
        return NULL;
    if (!get_addr || !free_addr || !consume_addr || !conn_addr) {
        PyErr_SetString(PyExc_ValueError, "drain_copy: a null address");
        return NULL;
    }
    pq_get_copy_data_fn get_copy_data = (pq_get_copy_data_fn)(uintptr_t)get_addr;
    pq_freemem_fn freemem = (pq_freemem_fn)(uintptr_t)free_addr;
    pq_consume_input_fn consume_input = (pq_consume_input_fn)(uintptr_t)consume_addr;
    void *conn = (void *)(uintptr_t)conn_addr;

    Py_ssize_t cap = 1 << 16, len = 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, cap);
    if (out == NULL)
        return NULL;
    int status = 1, read_socket = 0;
    while (len < limit) {
        char *row = NULL;
        int n = get_copy_data(conn, &row, 1);
        if (n > 0) {
            if (len + n > cap) {
                Py_ssize_t want = cap * 2 > len + n ? cap * 2 : len + n;
                if (_PyBytes_Resize(&out, want) < 0) {
                    freemem(row);
                    return NULL;
                }
                cap = want;
            }
            memcpy(PyBytes_AS_STRING(out) + len, row, (size_t)n);
            len += n;
            freemem(row);
            read_socket = 0;
            continue;
        }
        if (n == 0 && !read_socket) {
            /* Nothing whole in libpq's buffer: take what the socket holds, once, then look again. */
            if (!consume_input(conn)) {
                status = -2;
                break;
            }
            read_socket = 1;
            continue;
        }
        status = n; /* 0: nothing more without waiting; -1: the end; -2: an error */
        break;
    }
    if (_PyBytes_Resize(&out, len) < 0)
        return NULL;
    return Py_BuildValue("iN", status, out);
}

static PyMethodDef methods[] = {
    {"walk_changes", walk_changes, METH_VARARGS, walk_changes_doc},
    {"walk_copy", walk_copy, METH_VARARGS, walk_copy_doc},
    {"gather_fixed", gather_fixed, METH_VARARGS, gather_fixed_doc},
    {"gather_var", gather_var, METH_VARARGS, gather_var_doc},
    {"numeric_decimal128", numeric_decimal128, METH_VARARGS, numeric_decimal128_doc},
    {"numeric_texts", numeric_texts, METH_VARARGS, numeric_texts_doc},
    {"array_counts", array_counts, METH_VARARGS, array_counts_doc},
    {"array_elements", array_elements, METH_VARARGS, array_elements_doc},
    {"hash_ranges", hash_ranges, METH_VARARGS, hash_ranges_doc},
    {"drain_copy", drain_copy, METH_VARARGS, drain_copy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "pg2delta.decode._tuples",
    .m_doc = "Byte-level inner loops of the pgoutput window decoder.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__tuples(void)
{
    return PyModule_Create(&module);
}
